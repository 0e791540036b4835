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


def _wire_bytes(x2d, scaling, fmt):
    """The wire's bytes for ``x2d`` (rows x K) by the torch reference codec: a bucket of
    ``rows * K`` elements at world ``rows``, so that chunk r is row r; ``scaling`` "bucket" (one
    scale per row) or "block" (one per 128 elements). Returns (payload uint8 rows x K, scale_inv
    fp32 rows x groups per row)."""
    rows, K = x2d.shape
    L, _ = make_layout([rows * K], rows, 0, scaling, x2d.dtype)
    assert L.chunk_numel == K
    TorchCodec(fmt).encode(x2d.reshape(-1), L)
    G = 1 if scaling == "bucket" else K // 128
    return L.payload(L.send, K).clone(), L.scales(L.send, K)[:, :G].clone()


def _te_quantizers(fmt):
    """TE's own whole-tensor quantizers: (one quantize per row with current scaling -> (payload,
    scale_inv per row), 1x128 block quantize of the whole matrix -> (payload, scale_inv per block))."""
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    dt = tex.DType.kFloat8E4M3 if fmt.name == "e4m3" else tex.DType.kFloat8E5M2

    def current_per_row(x2d):
        q = Float8CurrentScalingQuantizer(dt, x2d.device, rowwise=True, columnwise=False)
        outs = [q(row.contiguous()) for row in x2d]
        return (torch.stack([o._data.view(torch.uint8) for o in outs]),
                torch.stack([o._scale_inv.float().reshape(()) for o in outs]).view(-1, 1))

    def block_1x128(x2d):
        q = Float8BlockQuantizer(dt, rowwise=True, columnwise=False, amax_epsilon=0.0,
                                 force_pow_2_scales=False, block_scaling_dim=1)
        o = q(x2d)
        rows, K = x2d.shape
        si = o._rowwise_scale_inv.float()
        # TE keeps 1x128 scales transposed (blocks x rows, rows padded to 4) for its GEMMs
        si = si if tuple(si.shape) == (rows, K // 128) else si[:, :rows].t()
        return o._rowwise_data.view(torch.uint8).view(rows, K), si.contiguous()

    return current_per_row, block_1x128


@needs_te
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_te_own_quantizers_cannot_write_the_wire_format(fmt, dtype):
    """Why the TE backend casts under scales set by the wire rule instead of handing whole buckets to
    TE's quantizers. TE's current-scaling quantizer (one scale per tensor: bucket scaling) and its
    1x128 block quantizer (block scaling, power-of-two scales off, no epsilon) write the wire's bytes
    for finite groups, but:

    - a group holding an Inf or a NaN gets a finite scale_inv from TE (its scale function returns 1
      for a non-finite amax, and its cast saturates an Inf to +-fmax), where the wire needs
      scale_inv = NaN so that every rank sees the non-finite gradient;
    - the block quantizer caps an overflowing scale at the input type's largest value (bf16's
      3.39e38 for a bf16 bucket) where the wire caps at FLT_MAX;
    - neither takes a pre-scale (nccl_fp8 multiplies the scale by 1/sqrt(world)).

    So a TE whole-bucket quantize needs an amax pass of our own first, which is the pass the fused
    Triton kernels fold into the cast; the differing bytes are asserted here."""
    fmt = get_format(fmt)
    current_per_row, block_1x128 = _te_quantizers(fmt)
    torch.manual_seed(4242)
    rows, K = 8, 4096
    for kind in KINDS:  # finite groups: TE's bytes are the wire's
        x = sample(rows * K, kind, dtype).view(rows, K)
        for name, te_fn, scaling in (("current", current_per_row, "bucket"), ("block", block_1x128, "block")):
            want_q, want_si = _wire_bytes(x, scaling, fmt)
            got_q, got_si = te_fn(x)
            assert torch.equal(got_si, want_si), f"TE {name} scale_inv differs on finite {kind} data"
            assert torch.equal(got_q, want_q), f"TE {name} payload differs on finite {kind} data"

    x = sample(rows * K, "gauss", dtype).view(rows, K)
    x[2, 5] = math.inf
    x[5, 300] = math.nan
    for name, te_fn, scaling, group in (("current", current_per_row, "bucket", K),
                                        ("block", block_1x128, "block", 128)):
        want_q, want_si = _wire_bytes(x, scaling, fmt)
        got_q, got_si = te_fn(x)
        bad = [(2, 5 // group), (5, 300 // group)]
        for r, g in bad:
            assert torch.isnan(want_si[r, g]), "the wire marks a non-finite group with scale_inv NaN"
            assert torch.isfinite(got_si[r, g]), f"TE {name} now marks non-finite groups: revisit te_codec"
        if fmt.name == "e4m3":  # E4M3 has no Inf code: TE's saturating cast writes +-448
            inf_value = got_q[2, 5:6].view(fmt.dtype).float() * got_si[2, 5 // group]
            assert torch.isfinite(inf_value).all(), f"TE {name} decodes the Inf as a finite value"
        finite = torch.isfinite(want_si)
        assert int(finite.sum()) == want_si.numel() - len(bad)
        assert torch.equal(got_si[finite], want_si[finite]), f"TE {name}: finite groups must still agree"

    if dtype == torch.bfloat16:  # a block whose scale overflows fp32: TE caps at bf16's max
        x = sample(rows * K, "gauss", dtype).view(rows, K)
        x[0, :128] = torch.tensor(1e-37, dtype=dtype)
        want_q, want_si = _wire_bytes(x, "block", fmt)
        got_q, got_si = block_1x128(x)
        fmax_bf16 = torch.finfo(torch.bfloat16).max
        assert want_si[0, 0].item() == pytest.approx(1 / torch.finfo(torch.float32).max, rel=1e-6)
        assert got_si[0, 0].item() == pytest.approx(1 / fmax_bf16, rel=1e-6)
        assert not torch.equal(got_si[0, 0], want_si[0, 0])

    # nccl_fp8's pre-scale: the wire's scale_inv is sqrt(world) times TE's, which has no such input
    from fp8_comm_hook.codec.base import compute_scales
    x = sample(rows * K, "heavy", dtype).view(rows, K)
    xf = x.float()
    amax = torch.maximum(xf.amax(1, keepdim=True), -xf.amin(1, keepdim=True))
    want_si = torch.empty_like(amax)
    compute_scales(amax, fmt.fmax, 1 / math.sqrt(8), torch.empty_like(amax), want_si)
    got_q, got_si = current_per_row(x)
    assert torch.allclose(want_si, got_si * math.sqrt(8), rtol=1e-6)
    assert not torch.equal(want_si, got_si)


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
