"""GPU codecs against the torch reference: the Triton codec (and Transformer Engine's, when it
imports) must write the same bytes (payload and fp32 scale_inv) as :class:`TorchCodec` on CUDA.

Every test is marked ``gpu`` and skips, with the reason printed by ``-rs``, without CUDA, Triton or
Transformer Engine. Run with ``python -m pytest -m gpu -rs -q tests/test_gpu_codec.py``.
"""
import importlib.util
import math

import pytest
import torch

from fp8_comm_hook.codec.torch_codec import TorchCodec
from fp8_comm_hook.formats import get_format
from fp8_comm_hook.layout import BucketLayout

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _te_status():
    if not HAS_CUDA:
        return False, "no CUDA device"
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "Transformer Engine is not installed"
    try:
        from fp8_comm_hook.codec.te_codec import te_import_error
    except Exception as e:  # pragma: no cover
        return False, f"te_codec failed to import: {e!r}"
    err = te_import_error()
    return (err is None), (f"Transformer Engine failed to import: {err!r}" if err else "")


HAS_TE, TE_REASON = _te_status()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
needs_te = pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "Transformer Engine unavailable")

DEV = "cuda"
SCALINGS = ("block", "tensor", "bucket")
FMTS = ("e4m3", "e5m2")
DTYPES = (torch.float32, torch.bfloat16)
KINDS = ("gauss", "heavy", "outlier")
MULTI = [1000, 1, 127, 100_003, 4097, 33]
# (numels of the bucket's parameters, world size)
ENCODE_CASES = [([1], 2), ([127], 3), ([100_003], 8), ([6_553_600], 8), (MULTI, 3), ([65_536, 7, 65_536], 1)]


# --------------------------------------------------------------------------- helpers
def make_layout(numels, world, rank, scaling, dtype=torch.float32, block_size=128):
    """A layout of a bucket holding ``numels`` parameters back to back (and its total numel)."""
    offs, o = [], 0
    for n in numels:
        offs.append(o)
        o += n
    L = BucketLayout(numels, offs, [f"p{i}" for i in range(len(numels))], world, rank, block_size, scaling, o,
                     dtype, DEV)
    return L, o


def sample(n, kind, dtype=torch.float32):
    """Gaussian, Student-t(2) heavy-tailed, or small Gaussian with large outliers."""
    if kind == "gauss":
        x = torch.randn(n, device=DEV)
    elif kind == "heavy":
        x = torch.distributions.StudentT(torch.tensor(2.0, device=DEV)).sample((n,))
    else:
        x = torch.randn(n, device=DEV) * 1e-3
        if n:
            idx = torch.randint(0, n, (max(1, n // 997),), device=DEV)
            x[idx] = torch.randn(idx.numel(), device=DEV).sign() * 300.0
    return x.to(dtype)


def triton_codec(fmt, **kw):
    from fp8_comm_hook.codec.triton_codec import TritonCodec
    return TritonCodec(get_format(fmt), **kw)


def assert_same_bytes(got, want, L, what):
    """Packed buffers equal byte for byte; on failure say whether payload or scales differ."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if torch.equal(got, want):
        return
    C = L.chunk_numel
    diff = (got != want)
    pay = int(diff[..., :C].sum())
    sc = int(diff[..., C:].sum())
    first = diff.nonzero()[:5].tolist()
    raise AssertionError(f"{what}: {pay} payload bytes and {sc} scale bytes differ (first at {first})")


def assert_residual_close(got, want, what):
    """Error-feedback residuals agree to fp32 rounding."""
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * max(scale, 1e-30), msg=what)


def fill_recv(L, codec, kinds=KINDS, dtype=torch.float32):
    """Fill ``L.recv`` with what W ranks holding different data would send to rank ``L.rank``."""
    n = L.src_numel
    for s in range(L.world_size):
        flat = sample(n, kinds[s % len(kinds)], dtype) * (1 + s)
        codec.encode(flat, L)
        L.recv[s].copy_(L.send[L.rank])


# --------------------------------------------------------------------------- Triton vs torch
@needs_triton
@pytest.mark.parametrize("numels,world", ENCODE_CASES, ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_encode_bytes_match_torch(scaling, fmt, dtype, numels, world):
    """encode: same send bytes for Gaussian, heavy-tailed and outlier data, with and without residual."""
    torch.manual_seed(1000 + len(numels) + world)
    tc, tr = TorchCodec(get_format(fmt)), triton_codec(fmt)
    La, n = make_layout(numels, world, world - 1, scaling, dtype)
    Lb, _ = make_layout(numels, world, world - 1, scaling, dtype)
    for kind in KINDS:
        flat = sample(n, kind, dtype)
        tc.encode(flat, La)
        tr.encode(flat, Lb)
        assert_same_bytes(Lb.send, La.send, La, f"encode {scaling} {fmt} {dtype} {kind}")
    # error feedback: residual in, new residual out
    ra, rb = La.ensure_residual(), Lb.ensure_residual()
    for i, m in enumerate(numels):
        La.segment(ra, i).copy_(torch.randn(m, device=DEV) * 0.01)
    rb.copy_(ra)
    flat = sample(n, "heavy", dtype)
    tc.encode(flat, La, ra)
    tr.encode(flat, Lb, rb)
    assert_same_bytes(Lb.send, La.send, La, f"encode+residual {scaling} {fmt} {dtype}")
    assert_residual_close(rb, ra, f"encode residual {scaling} {fmt} {dtype}")


@needs_triton
@pytest.mark.parametrize("numels", [[100_003], MULTI, [6_553_600]], ids=["100003", "multi", "6553600"])
@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_reduce_shard_bytes_match_torch(scaling, fmt, world, numels):
    """reduce_shard: same gather_in bytes from W real encoded chunks; residual fold to fp32 rounding."""
    if numels == [6_553_600] and world != 8:
        pytest.skip("the largest bucket runs at world 8 only (keeps the suite short)")
    torch.manual_seed(2000 + world)
    tc, tr = TorchCodec(get_format(fmt)), triton_codec(fmt)
    for rank in sorted({0, world - 1}):
        La, _ = make_layout(numels, world, rank, scaling)
        Lb, _ = make_layout(numels, world, rank, scaling)
        fill_recv(La, tc)
        Lb.recv.copy_(La.recv)
        tc.reduce_shard(La)
        tr.reduce_shard(Lb)
        assert_same_bytes(Lb.gather_in, La.gather_in, La, f"reduce {scaling} {fmt} W={world} rank={rank}")
        ra, rb = La.ensure_residual(), Lb.ensure_residual()
        ra.normal_(0, 0.01)
        rb.copy_(ra)
        tc.reduce_shard(La, ra)
        tr.reduce_shard(Lb, rb)
        assert_same_bytes(Lb.gather_in, La.gather_in, La, f"reduce+residual {scaling} {fmt} W={world}")
        assert_residual_close(rb, ra, f"reduce residual {scaling} {fmt} W={world} rank={rank}")


@needs_triton
@pytest.mark.parametrize("numels,world", [([127], 3), ([100_003], 8), (MULTI, 3), ([6_553_600], 8)],
                         ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_decode_matches_torch(scaling, fmt, dtype, numels, world):
    """decode: the same bucket values (bits) in the bucket's dtype."""
    torch.manual_seed(3000 + world)
    tc, tr = TorchCodec(get_format(fmt)), triton_codec(fmt)
    La, n = make_layout(numels, world, 0, scaling, dtype)
    Lb, _ = make_layout(numels, world, 0, scaling, dtype)
    for r in range(world):  # every rank's requantized shard, from real data
        tc.encode(sample(n, KINDS[r % 3], dtype), La)
        La.gather_out[r].copy_(La.send[r])
    Lb.gather_out.copy_(La.gather_out)
    fa = torch.full((n,), 7.0, device=DEV, dtype=dtype)
    fb = fa.clone()
    tc.decode(La, fa)
    out = tr.decode(Lb, fb)
    assert out is fb
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(fa.view(bits), fb.view(bits)), \
        f"decode {scaling} {fmt} {dtype}: {(fa != fb).sum().item()} values differ"


@needs_triton
@pytest.mark.parametrize("block_size", [16, 8192])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_other_block_sizes(scaling, block_size):
    """The smallest and largest block sizes through all three stages."""
    torch.manual_seed(4000 + block_size)
    fmt = "e4m3"
    tc, tr = TorchCodec(get_format(fmt)), triton_codec(fmt)
    numels = [20_000, 3, 8193]
    La, n = make_layout(numels, 3, 1, scaling, block_size=block_size)
    Lb, _ = make_layout(numels, 3, 1, scaling, block_size=block_size)
    flat = sample(n, "heavy")
    tc.encode(flat, La)
    tr.encode(flat, Lb)
    assert_same_bytes(Lb.send, La.send, La, f"encode bs={block_size}")
    fill_recv(La, tc)
    Lb.recv.copy_(La.recv)
    tc.reduce_shard(La)
    tr.reduce_shard(Lb)
    assert_same_bytes(Lb.gather_in, La.gather_in, La, f"reduce bs={block_size}")
    La.gather_out.copy_(La.send)
    Lb.gather_out.copy_(La.send)
    fa, fb = torch.zeros(n, device=DEV), torch.ones(n, device=DEV)
    tc.decode(La, fa)
    tr.decode(Lb, fb)
    assert torch.equal(fa, fb)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_primitives_match_torch(scaling, fmt):
    """group_amax, quantize_with_amax (with an nccl_fp8 pre-scale), dequantize, dequantize_sum."""
    torch.manual_seed(5000)
    L, n = make_layout(MULTI, 3, 1, scaling)
    g = L.groups
    x = L.gather_from(sample(n, "heavy"))
    outs = {}
    for codec in (TorchCodec(get_format(fmt)), triton_codec(fmt)):
        amax = torch.zeros(g.num_groups, device=DEV)
        codec.group_amax(x, g, L.work, L.block_amax, amax)
        pay = torch.zeros(g.rows, g.chunk_numel, dtype=torch.uint8, device=DEV)
        sinv = torch.zeros(g.rows, g.groups_per_row, device=DEV)
        codec.quantize_with_amax(x, g, amax, pay, sinv, pre_scale=1 / math.sqrt(3), work=L.work,
                                 group_scale=L.group_scale, block_scale=L.block_scale)
        deq = codec.dequantize(pay, sinv, g, torch.zeros(L.padded_numel, device=DEV), L.block_scale).clone()
        s = codec.dequantize_sum(pay, sinv, g, torch.zeros(g.chunk_numel, device=DEV), L.work, L.block_scale).clone()
        outs[codec.name] = (amax, pay, sinv, deq, s)
    for a, b, what in zip(outs["torch"], outs["triton"], ("amax", "payload", "scale_inv", "dequantize", "sum")):
        assert torch.equal(a, b), f"{what} differs ({scaling} {fmt})"


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_nonfinite_blocks_get_nan_scale(scaling, fmt):
    """An Inf or NaN gives scale_inv NaN in exactly the groups holding it, on encode and reduce."""
    torch.manual_seed(6000)
    numels = [5000, 1, 300, 70_000]
    tc, tr = TorchCodec(get_format(fmt)), triton_codec(fmt)
    La, n = make_layout(numels, 3, 0, scaling)
    Lb, _ = make_layout(numels, 3, 0, scaling)
    flat = sample(n, "gauss")
    bad = {7: math.inf, 5000: math.nan, 5100: -math.inf, 40_000: math.nan}
    for p, v in bad.items():
        flat[p] = v
    tc.encode(flat, La)
    tr.encode(flat, Lb)
    C, bs = La.chunk_numel, La.block_size
    expect = torch.zeros(La.groups.num_groups, dtype=torch.bool)
    bg = La.groups.block_group.cpu() if La.groups.block_group is not None else None
    for p in bad:
        i = max(k for k, o in enumerate(La.src_offsets) if o <= p and numels[k] > 0)
        block = (La.dst_offsets[i] + p - La.src_offsets[i]) // bs
        expect[block if bg is None else int(bg[block])] = True
    for L, name in ((La, "torch"), (Lb, "triton")):
        got = torch.isnan(L.scales(L.send, C)).reshape(-1).cpu()
        assert torch.equal(got, expect), f"{name}: NaN scales at {got.nonzero().view(-1).tolist()}, " \
                                         f"expected {expect.nonzero().view(-1).tolist()}"
    fin = ~expect.view(La.world_size, -1).to(DEV)
    assert torch.equal(La.scales(La.send, C)[fin], Lb.scales(Lb.send, C)[fin])
    poisoned = La.send.clone()
    # reduce: a NaN scale from one source poisons exactly the same groups of the shard
    fill_recv(La, tc)
    La.scales(La.recv, C)[1, 0] = float("nan")
    Lb.recv.copy_(La.recv)
    tc.reduce_shard(La)
    tr.reduce_shard(Lb)
    ga, gb = La.scales(La.gather_in, C), Lb.scales(Lb.gather_in, C)
    assert torch.equal(torch.isnan(ga), torch.isnan(gb)) and bool(torch.isnan(gb[0]))
    assert torch.equal(ga[~torch.isnan(ga)], gb[~torch.isnan(gb)])
    # decode: NaN comes out in exactly those groups
    La.gather_out.copy_(poisoned)
    Lb.gather_out.copy_(poisoned)
    fa, fb = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    tc.decode(La, fa)
    tr.decode(Lb, fb)
    assert bool(torch.isnan(fb).any())
    assert torch.equal(torch.isnan(fa), torch.isnan(fb))
    assert torch.equal(fa[~torch.isnan(fa)], fb[~torch.isnan(fb)])


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", ["block", "tensor"])
def test_software_cast_matches_hardware(scaling, fmt):
    """The exact software FP8 cast (what the interpreter tests run) equals the GPU's cast."""
    torch.manual_seed(7000)
    tc, tr = TorchCodec(get_format(fmt)), triton_codec(fmt)
    tr._soft_fp8 = True
    La, n = make_layout(MULTI, 3, 2, scaling)
    Lb, _ = make_layout(MULTI, 3, 2, scaling)
    for kind in KINDS:
        flat = sample(n, kind)
        tc.encode(flat, La)
        tr.encode(flat, Lb)
        assert_same_bytes(Lb.send, La.send, La, f"soft cast {scaling} {fmt} {kind}")


@needs_triton
@pytest.mark.parametrize("scaling", SCALINGS)
def test_launch_counts(scaling, monkeypatch):
    """two_shot's stages: block scaling one launch each, tensor/bucket at most two."""
    from fp8_comm_hook.codec.triton_codec import TritonCodec
    tr = triton_codec("e4m3")
    L, n = make_layout(MULTI, 3, 1, scaling)
    flat = sample(n, "gauss")
    res = L.ensure_residual()
    tr.encode(flat, L, res)  # builds the per-layout plan
    calls = []
    real = TritonCodec._launch

    def counting(kernel, grid, device, *args, **kwargs):
        calls.append(kernel.__name__ if hasattr(kernel, "__name__") else str(kernel))
        return real(kernel, grid, device, *args, **kwargs)

    monkeypatch.setattr(TritonCodec, "_launch", staticmethod(counting))
    limit = 1 if scaling == "block" else 2
    for stage in ("encode", "reduce_shard", "decode"):
        calls.clear()
        if stage == "encode":
            tr.encode(flat, L, res)
        elif stage == "reduce_shard":
            tr.reduce_shard(L, res)
        else:
            tr.decode(L, flat)
        want = 1 if stage == "decode" else limit
        assert len(calls) == want, f"{stage} launched {calls}"


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_rounding_unbiased_and_deterministic(fmt):
    """SR: deterministic per seed, RNE scales, and the mean of many draws beats RNE."""
    torch.manual_seed(8000)
    numels = [200_000, 37]
    L, n = make_layout(numels, 2, 0, "block")
    C = L.chunk_numel
    x = torch.randn(n, device=DEV)
    sr = triton_codec(fmt, stochastic_rounding=True)
    g = torch.Generator(device=DEV)
    g.manual_seed(7)
    sr.encode(x, L, generator=g)
    first = L.send.clone()
    g.manual_seed(7)
    sr.encode(x, L, generator=g)
    assert torch.equal(first, L.send), "same seed must give the same bytes"
    g.manual_seed(8)
    sr.encode(x, L, generator=g)
    assert not torch.equal(first, L.send), "another seed must give other bytes"
    if hasattr(g, "get_offset"):
        g.manual_seed(7)
        sr.encode(x, L, generator=g)
        sr.encode(x, L, generator=g)
        assert not torch.equal(first, L.send), "a second call without reseeding must draw new numbers"
    # scales are the RNE scales; only the rounding of the payload changes
    rne = triton_codec(fmt)
    Lr, _ = make_layout(numels, 2, 0, "block")
    rne.encode(x, Lr)
    assert torch.equal(L.scales(L.send, C), Lr.scales(Lr.send, C))
    deq = torch.empty(L.padded_numel, device=DEV)

    def values(layout):
        sr.dequantize(layout.payload(layout.send, C), layout.scales(layout.send, C), layout.groups, deq,
                      layout.block_scale)
        return torch.cat([layout.segment(deq, i) for i in range(len(numels))])

    total = torch.zeros(n, device=DEV)
    reps = 64
    for i in range(reps):
        g.manual_seed(100 + i)
        sr.encode(x, L, generator=g)
        total += values(L)
    err_sr = float((total / reps - x).norm() / x.norm())
    err_rne = float((values(Lr) - x).norm() / x.norm())
    assert err_sr < 0.5 * err_rne, (err_sr, err_rne)
    # the owner's requantization is stochastic too, and deterministic for a seed
    fill_recv(L, TorchCodec(get_format(fmt)))
    g.manual_seed(3)
    sr.reduce_shard(L, generator=g)
    a = L.gather_in.clone()
    g.manual_seed(3)
    sr.reduce_shard(L, generator=g)
    assert torch.equal(a, L.gather_in)


# --------------------------------------------------------------------------- Transformer Engine
@needs_te
@pytest.mark.parametrize("numels,world", [([127], 3), (MULTI, 3), ([6_553_600], 8)], ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling", ["tensor", "bucket"])
def test_te_bytes_match_torch(scaling, fmt, dtype, numels, world):
    """TE: same bytes as torch for encode and reduce; an Inf still gives a NaN scale."""
    from fp8_comm_hook.codec.te_codec import TECodec
    torch.manual_seed(9000 + world)
    tc, te = TorchCodec(get_format(fmt)), TECodec(get_format(fmt))
    La, n = make_layout(numels, world, world - 1, scaling, dtype)
    Lb, _ = make_layout(numels, world, world - 1, scaling, dtype)
    for kind in KINDS:
        flat = sample(n, kind, dtype)
        tc.encode(flat, La)
        te.encode(flat, Lb)
        assert_same_bytes(Lb.send, La.send, La, f"TE encode {scaling} {fmt} {dtype} {kind}")
    fill_recv(La, tc)
    Lb.recv.copy_(La.recv)
    tc.reduce_shard(La)
    te.reduce_shard(Lb)
    assert_same_bytes(Lb.gather_in, La.gather_in, La, f"TE reduce {scaling} {fmt}")
    flat = sample(n, "gauss", dtype)
    flat[min(3, n - 1)] = math.inf
    tc.encode(flat, La)
    te.encode(flat, Lb)
    C = La.chunk_numel
    assert torch.equal(torch.isnan(La.scales(La.send, C)), torch.isnan(Lb.scales(Lb.send, C)))
    assert bool(torch.isnan(Lb.scales(Lb.send, C)).any()), "TE must not hide an Inf"


@needs_te
def test_te_refuses_block_scaling():
    """TE with block scaling is a clear ValueError."""
    from fp8_comm_hook.codec.te_codec import TECodec
    L, n = make_layout([1000], 2, 0, "block")
    with pytest.raises(ValueError, match="block"):
        TECodec(get_format("e4m3")).encode(torch.randn(n, device=DEV), L)


# --------------------------------------------------------------------------- two_shot over gloo on one GPU
def _all_reduce_backends(rank, world):
    """Per rank: the all_reduce result of every config with the triton and the torch backend."""
    import fp8_comm_hook
    from fp8_comm_hook import FP8CommConfig
    torch.cuda.set_device(0)
    out = {}
    configs = [dict(scaling="block"), dict(scaling="tensor", fp8_format="e5m2"), dict(scaling="bucket"),
               dict(scaling="block", error_feedback=True)]
    for ci, kw in enumerate(configs):
        for shape in [(1000, 37), (100_003,)]:
            g = torch.Generator().manual_seed(100 * ci + 10 * rank + len(shape))
            x = (torch.randn(shape, generator=g) * (1 + rank)).to(DEV)
            res = {}
            for backend in ("triton", "torch"):
                cfg = FP8CommConfig(backend=backend, min_compress_numel=0, **kw)
                steps = []
                for _ in range(2):  # two steps: the second one carries the residual
                    steps.append(fp8_comm_hook.all_reduce(x.clone(), cfg).cpu())
                res[backend] = torch.stack(steps)
            out[(ci, shape)] = (res["triton"], res["torch"], x.cpu())
    return out


@needs_triton
@pytest.mark.parametrize("world", [2, 3])
def test_two_shot_gloo_cuda_triton_equals_torch(world):
    """fp8_comm_hook.all_reduce with CUDA tensors on a gloo group (ranks share the GPU): Triton's
    result is bit-identical to torch's, on every rank, and close to the true mean."""
    from dist_harness import run_world, values
    per_rank = values(run_world(world, [_all_reduce_backends]), "_all_reduce_backends")
    for key in per_rank[0]:
        tri0 = per_rank[0][key][0]
        mean = sum(per_rank[r][key][2] for r in range(world)) / world
        for r in range(world):
            tri, tor, _ = per_rank[r][key]
            assert torch.equal(tri.view(torch.int32), tor.view(torch.int32)), f"{key} rank {r}: triton != torch"
            assert torch.equal(tri.view(torch.int32), tri0.view(torch.int32)), f"{key}: rank {r} != rank 0"
        rel = float((tri0[0] - mean).norm() / mean.norm())
        assert rel < 0.2, (key, rel)
