"""The torch codec (the wire format's reference) against an fp64 model, on seeded data."""
import math

import pytest
import torch

from codec_ref import data, encode_decode, make_layout, reference_group_amax
from fp8_comm_hook.codec import TorchCodec, compute_scales
from fp8_comm_hook.formats import FLOAT32_MAX, get_format

KINDS = ["gauss", "student_t", "outliers"]
# One RNE quantization of Gaussian data with blocks of 128: E4M3 ~0.026 (design.md), E5M2 ~0.05.
SINGLE_QUANT_BOUND = {"e4m3": 0.030, "e5m2": 0.060}


def rel_err(y, x):
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scaling", ["block", "tensor", "bucket"])
def test_scales_are_fmax_over_amax(fmt, kind, scaling):
    numels = [100_003, 1, 517, 4096]
    x = data(kind, sum(numels), seed=11)
    L, _ = encode_decode(x, numels, fmt=fmt, scaling=scaling, world_size=3)
    fmax = get_format(fmt).fmax
    amax = reference_group_amax(L, x)
    sinv = L.scales(L.send, L.chunk_numel).reshape(-1).double()
    # scale_inv must equal amax / fmax (to fp32 rounding of two divisions): a 2x error fails here.
    pos = amax > 0
    torch.testing.assert_close(sinv[pos], amax[pos] / fmax, rtol=2e-7, atol=0)
    assert torch.all(sinv[~pos] == 1.0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", KINDS)
def test_error_against_fp64(fmt, kind):
    x = data(kind, 100_003, seed=5)
    _, y = encode_decode(x, [x.numel()], fmt=fmt)
    err = rel_err(y, x)
    assert err < SINGLE_QUANT_BOUND[fmt]
    if kind == "gauss":  # not suspiciously small either: FP8 must actually have rounded
        assert err > SINGLE_QUANT_BOUND[fmt] * 0.7


def test_bucket_scaling_loses_precision_on_outliers():
    # a sanity check of the geometry: one scale per chunk is worse than one per block with outliers
    x = data("outliers", 50_000, seed=3)
    _, yb = encode_decode(x, [x.numel()], scaling="block")
    _, yk = encode_decode(x, [x.numel()], scaling="bucket")
    assert rel_err(yk, x) > 2 * rel_err(yb, x)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_exact_round_trip_of_representable_values(fmt):
    f = get_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(f.dtype).float()
    vals = vals[torch.isfinite(vals)]
    g = torch.Generator().manual_seed(0)
    blocks = []
    for k in range(-20, 21, 5):  # every block holds +-fmax so its scale is an exact power of two
        b = vals[torch.randint(0, vals.numel(), (128,), generator=g)]
        b[0] = f.fmax
        blocks.append(b * 2.0 ** k)
    x = torch.cat(blocks)
    L, y = encode_decode(x, [x.numel()], fmt=fmt)
    assert torch.equal(y, x)
    sinv = L.scales(L.send, L.chunk_numel).reshape(-1)[:len(blocks)]
    assert torch.equal(sinv, torch.tensor([2.0 ** k for k in range(-20, 21, 5)]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("chunk", [100, 2000])
def test_cpu_table_decode_equals_torch_cast(fmt, strided, chunk, monkeypatch):
    """The CPU decode (a table of all 256 codes, in chunks) gives torch's FP8 cast bit for bit: every
    code (NaN, Inf for E5M2, subnormals, -0.0) in rows that are strided views of a packed buffer or
    one contiguous run; chunks shorter than a row (100: each row in pieces, not dividing it) and
    holding whole rows (2000: two rows per lookup, then the odd one)."""
    from fp8_comm_hook.codec import torch_codec
    monkeypatch.setattr(torch_codec, "_LUT_CHUNK", chunk)
    monkeypatch.setattr(torch_codec, "_LUT_MIN", 0)
    codec = TorchCodec(get_format(fmt))
    rows, C = 3, 777
    gen = torch.Generator().manual_seed(7)
    codes = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(rows * C // 256 + 1)])[:rows * C]
    codes = codes[torch.randperm(rows * C, generator=gen)].view(rows, C)
    packed = torch.zeros(rows, C + 13 if strided else C, dtype=torch.uint8)
    packed[:, :C] = codes
    payload = packed[:, :C]
    assert payload.is_contiguous() != strided
    out = torch.full((rows, C), 12345.0)
    codec._fp8_to_fp32(payload, out)
    ref = payload.view(get_format(fmt).dtype).float()
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))   # bits: NaN payloads and -0.0 too


@pytest.mark.parametrize("case", ["finite", "inf", "nan", "sum_overflows"])
def test_keep_finite_updates_only_finite_values(case):
    """Error feedback's residual update: ``updated`` where finite, the old residual elsewhere; the
    CPU's shortcut (a finite sum: copy) and its mask path agree, also where every value is finite
    but their sum leaves the fp32 range."""
    from fp8_comm_hook.codec.base import keep_finite_
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(10_000, generator=gen)
    updated = torch.randn(10_000, generator=gen)
    if case == "inf":
        updated[[5, 9999]] = torch.tensor([float("inf"), -float("inf")])
    elif case == "nan":
        updated[1234] = float("nan")
    elif case == "sum_overflows":
        updated[:4] = 3e38
    assert bool(torch.isfinite(updated.sum())) == (case == "finite")
    expect = torch.where(torch.isfinite(updated), updated, old)
    residual = old.clone()
    assert keep_finite_(residual, updated) is residual
    assert torch.equal(residual, expect)
    assert bool(torch.isfinite(residual).all())


@pytest.mark.parametrize("scaling", ["block", "tensor", "bucket"])
def test_group_amax_is_the_max_of_abs_bit_for_bit(scaling):
    """group_amax (max of max and -min per block) equals the amax of |x| to the bit on Gaussian and
    heavy-tailed data with outliers, blocks of only -0.0 or only +0.0 (+0.0 out, as |x| gives), blocks holding
    -Inf or +Inf (+Inf) and NaN (+Inf, so a MAX all-reduce keeps it)."""
    gen = torch.Generator().manual_seed(11)
    numels = [4096, 1000, 640, 3]
    L = make_layout(numels, world_size=2, scaling=scaling)
    x = torch.randn(sum(numels), generator=gen)
    x[:1000] = torch.distributions.StudentT(1.5).sample((1000,))
    x[::997] *= 1e4
    x[128:256] = -0.0
    x[256:384] = 0.0
    x[300], x[700], x[1200] = -float("inf"), float("inf"), float("nan")
    codec = TorchCodec(get_format("e4m3"))
    staged = L.gather_from(x).clone()
    got = codec.group_amax(staged, L.groups, L.work, L.block_amax, L.group_amax)[:L.groups.num_groups].clone()
    inf = float("inf")
    blocks = staged[:L.groups.rows * L.chunk_numel].abs().view(-1, L.block_size).amax(1).nan_to_num(nan=inf, posinf=inf)
    if L.groups.block_group is None:
        want = blocks
    else:
        want = torch.zeros(L.groups.num_groups).scatter_reduce(0, L.groups.block_group, blocks, "amax")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got.double(), reference_group_amax(L, x).nan_to_num(nan=inf, posinf=inf))


def test_zeros_get_scale_one():
    x = torch.zeros(1000)
    L, y = encode_decode(x, [1000])
    assert torch.equal(y, x)
    assert torch.all(L.scales(L.send, L.chunk_numel) == 1.0)
    assert torch.all(L.payload(L.send, L.chunk_numel) == 0)


def test_one_element_and_empty():
    x = torch.tensor([-3.7])
    L, y = encode_decode(x, [1])
    assert L.padded_numel == 128
    torch.testing.assert_close(y, x, rtol=0.07, atol=0)  # one E4M3 rounding
    assert L.scales(L.send, L.chunk_numel)[0, 0].item() == pytest.approx(3.7 / 448, rel=1e-6)
    L, y = encode_decode(torch.zeros(0), [0], world_size=2)
    assert y.numel() == 0 and L.padded_numel == 256


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_makes_exactly_its_block_nan(fmt, bad):
    x = data("gauss", 1000, seed=1)
    x[300] = bad  # block 2 (elements 256..383)
    L, y = encode_decode(x, [1000], fmt=fmt)
    sinv = L.scales(L.send, L.chunk_numel).reshape(-1)
    assert torch.isnan(sinv[2]) and torch.isfinite(sinv[:2]).all() and torch.isfinite(sinv[3:]).all()
    assert torch.isnan(y[256:384]).all()
    assert torch.isfinite(y[:256]).all() and torch.isfinite(y[384:]).all()


def test_clamp_before_cast_never_makes_nan_from_finite():
    # amax-derived scales put values exactly at fmax; rounding must not push them out of range
    x = torch.tensor([1.0, -1.0, 0.99999994, 1e-30] * 32)
    _, y = encode_decode(x, [x.numel()])
    assert torch.isfinite(y).all()
    assert y[0] == 1.0 and y[1] == -1.0


def test_extreme_magnitudes():
    for mag in (1e-38, 1e-30, 1e30, 3e38):
        x = data("gauss", 512, seed=2) * mag / 4
        x = x.clamp(-3.4e38, 3.4e38)
        _, y = encode_decode(x, [512])
        assert torch.isfinite(y).all()
        assert rel_err(y, x) < 0.03, mag


def test_compute_scales_rule():
    amax = torch.tensor([448.0, 0.0, 1e-45, float("inf"), 2.0])
    s, si = torch.empty(5), torch.empty(5)
    compute_scales(amax, 448.0, 1.0, s, si)
    assert s[0] == 1.0 and si[0] == 1.0
    assert s[1] == 1.0 and si[1] == 1.0
    assert s[2] == FLOAT32_MAX  # a denormal amax clamps the scale instead of overflowing
    assert math.isnan(si[3])
    assert s[4] == 224.0 and si[4] == 1 / 224.0
    compute_scales(amax, 448.0, 0.5, s, si)
    assert s[4] == 112.0 and s[1] == 1.0


def test_blocks_never_straddle_parameters():
    # the same gradient quantizes identically whatever comes before it in the bucket
    g = data("student_t", 1000, seed=9)
    for prefix in (0, 1, 129, 300):
        other = data("gauss", prefix, seed=1) * 100 if prefix else torch.zeros(0)
        x = torch.cat([other, g])
        numels = [prefix, 1000] if prefix else [1000]
        _, y = encode_decode(x, numels, scaling="block")
        ref = encode_decode(g, [1000])[1]
        assert torch.equal(y[prefix:], ref)


@pytest.mark.parametrize("scaling", ["block", "tensor", "bucket"])
def test_dequantize_sum_adds_in_rank_order(scaling):
    W, numels = 3, [700, 1300]
    n = sum(numels)
    codec = TorchCodec(get_format("e4m3"))
    xs = [data("gauss", n, seed=s) for s in range(W)]
    layouts = [make_layout(numels, W, 1, scaling=scaling) for _ in range(W)]
    for L, x in zip(layouts, xs):
        codec.encode(x, L)
    L = layouts[0]
    C = L.chunk_numel
    recv = torch.stack([Lw.send[1] for Lw in layouts])  # chunk 1 from every rank
    out = torch.empty(C)
    codec.dequantize_sum(L.payload(recv, C), L.scales(recv, C), L.own_groups_all_sources, out, L.work, L.block_scale)
    expect = torch.zeros(C)
    for Lw in layouts:
        deq = torch.empty(Lw.padded_numel)
        codec.dequantize(Lw.payload(Lw.send, C), Lw.scales(Lw.send, C), Lw.groups, deq, Lw.block_scale)
        expect += deq[C:2 * C]
    assert torch.equal(out, expect)


def test_stochastic_rounding_is_unbiased_and_on_grid():
    f = get_format("e4m3")
    codec = TorchCodec(f, stochastic_rounding=True)
    x = data("gauss", 128, seed=4)
    x[0] = x.abs().max() * 1.0001
    L = make_layout([128])
    acc = torch.zeros(128, dtype=torch.float64)
    reps = 400
    g = torch.Generator().manual_seed(0)
    for _ in range(reps):
        codec.encode(x, L, generator=g)
        out = torch.empty(L.padded_numel)
        codec.dequantize(L.payload(L.send, 128), L.scales(L.send, 128), L.groups, out, L.block_scale)
        acc += out.double()
    rne = encode_decode(x, [128])[1]
    err_sr = (acc / reps - x.double()).norm().item()
    err_rne = (rne.double() - x.double()).norm().item()
    assert err_sr < err_rne / 3


def test_auto_backend_table_matches_committed_measurements():
    """``backend="auto"`` on CUDA picks, per scaling mode, the backend whose encode + reduce_shard +
    decode GPU time for a 6.55M-element fp32 bucket is the smaller in the committed H200 benchmark
    (for each bucket shape it has: aligned and odd parameter sizes must agree)."""
    import json
    import os

    from fp8_comm_hook.codec.select import FASTER_ON_GPU

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                        "codec-h200.json")
    with open(path) as f:
        rows = json.load(f)
    ops = ("quantize", "dequant_sum_requant", "dequantize")
    shapes = sorted({r.get("bucket") or "odd" for r in rows})
    assert shapes, f"no rows in {path}"
    for scaling in ("block", "tensor", "bucket"):
        for shape in shapes:
            total = {}
            for b in ("triton", "te"):
                sel = [r for r in rows if r["backend"] == b and r["scaling"] == scaling and r["dtype"] == "float32"
                       and r["numel"] == 6_553_600 and r["op"] in ops and (r.get("bucket") or "odd") == shape]
                if len(sel) == len(ops):
                    total[b] = sum(r["us"] for r in sel)
            assert "triton" in total, f"no Triton rows for scaling={scaling!r}, {shape} buckets in {path}"
            assert FASTER_ON_GPU[scaling] == min(total, key=total.get), (scaling, shape, total)
