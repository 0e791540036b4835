"""GPU paths of the core at world 1 over NCCL (the one-GPU case): nccl_fp8's FP8 SUM all-reduce, the
DDP hook with every algorithm, and the torch codec on CUDA matching the CPU bytes."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from codec_ref import data, encode_decode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="nccl_fp8 needs an sm90+ GPU (none visible)")
pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.fixture(scope="module")
def nccl_world1():
    d = tempfile.mkdtemp()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def rel(y, x):
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


@pytest.mark.parametrize("scaling", ["block", "tensor", "bucket"])
def test_torch_codec_cuda_bytes_match_cpu(scaling):
    x = data("student_t", 100_003, seed=1)
    Lc, yc = encode_decode(x, [50_000, 3, 50_000], scaling=scaling, world_size=3)
    from fp8_comm_hook.codec import TorchCodec
    from fp8_comm_hook.formats import get_format
    from fp8_comm_hook.layout import BucketLayout
    Lg = BucketLayout(Lc.numels, Lc.src_offsets, Lc.names, 3, 0, 128, scaling, x.numel(), x.dtype, "cuda")
    TorchCodec(get_format("e4m3")).encode(x.cuda(), Lg)
    assert torch.equal(Lg.send.cpu(), Lc.send)


@needs_sm90
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["block", "tensor"])
def test_nccl_fp8_all_reduce_world1(nccl_world1, fmt, scaling):
    from fp8_comm_hook import FP8CommConfig, all_reduce
    x = data("gauss", 1_000_003, seed=2).cuda()
    y = all_reduce(x.clone(), FP8CommConfig(algorithm="nccl_fp8", fp8_format=fmt, scaling=scaling, min_compress_numel=0))
    err = rel(y, x)
    # world 1: one quantization (pre_scale 1/sqrt(1) = 1), no FP8 rounding in the sum
    assert err < {"e4m3": 0.03, "e5m2": 0.06}[fmt] and err > {"e4m3": 0.018, "e5m2": 0.035}[fmt]
    x[17] = float("inf")
    assert not torch.isfinite(all_reduce(x, FP8CommConfig(algorithm="nccl_fp8", min_compress_numel=0))[:128]).any()


@pytest.mark.parametrize("algorithm", ["two_shot", "nccl_fp8", "none"])
def test_ddp_nccl_world1(nccl_world1, algorithm):
    if algorithm == "nccl_fp8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("nccl_fp8 needs sm90+")
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp8_comm_hook import FP8CommConfig, register_ddp_hook
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).cuda()
    ref = [p.detach().clone() for p in net.parameters()]
    d = DDP(net, device_ids=[0], bucket_cap_mb=0.5)
    st = register_ddp_hook(d, FP8CommConfig(algorithm=algorithm, min_compress_numel=0))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = torch.randn(512, 64, device="cuda", generator=g)
    ys = (xs[:, :10] * 3).argmax(1)
    first = last = None
    for step in range(30):
        loss = nn.functional.cross_entropy(d(xs), ys)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = loss.item()
    assert last < 0.3 * first, (first, last)
    s = st.stats()
    assert s["steps"] == 30
    if algorithm != "none":
        assert s["compressed_buckets"] >= 30
    assert s["nonfinite_buckets"] == 0


@needs_sm90
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nccl_fp8_error_feedback_after_inf_world1(nccl_world1, backend):
    """nccl_fp8 with error feedback and the automatic pre_scale: an Inf at step 1 makes that step
    non-finite, the next steps are finite with finite residuals, and the pre_scale is where the run
    without the Inf has it (the Inf's group is not counted as saturation)."""
    from fp8_comm_hook import FP8CommConfig, all_reduce
    from fp8_comm_hook.reduce import _ALL_REDUCE_STATES

    runs = {}
    for inject in (False, True):
        cfg = FP8CommConfig(algorithm="nccl_fp8", error_feedback=True, min_compress_numel=0, backend=backend,
                            seed=11 + inject)
        out = []
        for step in range(4):
            x = data("student_t", 300_000, seed=step).cuda()
            ref = x.clone()
            if inject and step == 1:
                x[5:10] = float("inf")  # 5 values at +-fmax in a NaN-scale group: above the 1e-5 halving threshold
            y = all_reduce(x, cfg)
            out.append((int((~torch.isfinite(y)).sum()), rel(y, ref) if step != 1 or not inject else None))
        st = _ALL_REDUCE_STATES[(cfg.replace(warmup_steps=0), None)]
        layout = st.live_layouts()[0]
        runs[inject] = dict(steps=out, pre_scale=layout.auto_pre_scale, saturated=st.stats()["saturated_values"],
                            residual_finite=bool(torch.isfinite(layout.residual).all()))
    hit, clean = runs[True], runs[False]
    assert hit["steps"][1][0] > 0
    for step in (0, 2, 3):
        assert hit["steps"][step][0] == 0, hit
        assert hit["steps"][step][1] < 0.06 and hit["steps"][step][1] <= 1.5 * clean["steps"][step][1] + 1e-3, (hit, clean)
    assert hit["residual_finite"] and hit["pre_scale"] == clean["pre_scale"], (hit, clean)


@pytest.mark.parametrize("variant", ["two_shot", "two_shot_ef", "torch_codec", "nccl_fp8_fixed_pre_scale",
                                     "nccl_fp8_auto_pre_scale"])
def test_ddp_cuda_graphs_match_eager(nccl_world1, monkeypatch, variant):
    """A bucket replayed as a captured CUDA graph gives exactly the eager path's mean, step after step
    (error feedback carried, an Inf step counted as non-finite), and the same statistics."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8_comm_hook import FP8CommConfig, register_ddp_hook
    if variant.startswith("nccl_fp8") and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("nccl_fp8 needs an sm90+ GPU")
    kw = {"two_shot": {}, "two_shot_ef": dict(error_feedback=True), "torch_codec": dict(backend="torch"),
          "nccl_fp8_fixed_pre_scale": dict(algorithm="nccl_fp8", pre_scale=0.5),
          "nccl_fp8_auto_pre_scale": dict(algorithm="nccl_fp8", error_feedback=True)}[variant]
    # The automatic pre_scale cycles (1 saturates at world 1, halves, grows back by 5% a step): its
    # values repeat after 16 steps, when their graphs are captured.
    steps = 40 if variant == "nccl_fp8_auto_pre_scale" else 6
    runs = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("FP8_COMM_CUDA_GRAPHS", graphs)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 64)).cuda()
        model = DDP(net, device_ids=[0], bucket_cap_mb=1)
        state = register_ddp_hook(model, FP8CommConfig(min_compress_numel=0, **kw))
        g = torch.Generator(device="cuda").manual_seed(1)
        grads = []
        for step in range(steps):
            x = torch.randn(32, 256, device="cuda", generator=g) * (1 + step % 6)
            if step == 3:
                x[0, 5] = float("inf")
            model(x).square().mean().backward()
            torch.cuda.synchronize()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
            model.zero_grad(set_to_none=False)
        runs[graphs] = (grads, state.stats(), state.bucket_graphs().captured(),
                        [L.auto_pre_scale for L in state.live_layouts()])
    (g1, s1, n1, ps1), (g0, s0, n0, ps0) = runs["1"], runs["0"]
    assert n1 > 0 and n0 == 0, (n1, n0)
    assert ps1 == ps0
    for step, (a, b) in enumerate(zip(g1, g0)):
        for ta, tb in zip(a, b):
            torch.testing.assert_close(ta, tb, rtol=0, atol=0, equal_nan=True, msg=f"step {step}")
    assert s1 == s0
    assert s1["steps"] == steps and s1["nonfinite_buckets"] >= 1 and s1["compressed_buckets"] >= steps


@needs_sm90
@pytest.mark.parametrize("scaling", ["block", "tensor", "bucket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout_world", [1, 3])
def test_nccl_fp8_triton_fused_matches_torch_codec(nccl_world1, scaling, dtype, layout_world):
    """nccl_fp8 with the Triton codec's fused stages (amax and quantize read the unpadded bucket,
    the mean, the division by W and the saturation count in one pass writing it back) gives the torch
    codec's bytes: the same wire, mean, residual and saturation count, for pre_scales that saturate
    and not, with and without error feedback, a bucket with padding between parameters and an Inf.
    ``layout_world`` 3: the layout of a 3-rank group (the sum itself runs on the 1-rank group, where
    it leaves the wire as it is), so the division by W rounds as it does at W = 3."""
    from fp8_comm_hook import collectives
    from fp8_comm_hook.codec import TorchCodec
    from fp8_comm_hook.codec.triton_codec import TritonCodec
    from fp8_comm_hook.formats import get_format
    from fp8_comm_hook.layout import BucketLayout

    numels, offsets = [50_000, 3, 70_001, 517], [0, 50_000, 50_003, 120_004]
    n = sum(numels)
    fmt = get_format("e4m3")
    saw_saturation = False
    for case, (pre_scale, ef, inf) in enumerate([(1.0, False, False), (8.0, False, False), (0.5, True, False),
                                                 (16.0, True, False), (1.0, True, True)]):
        x = (data("outliers", n, seed=case) * 3).to(device="cuda", dtype=dtype)
        if inf:
            x[60_000] = float("inf")
        out = {}
        for name, codec in (("torch", TorchCodec(fmt)), ("triton", TritonCodec(fmt))):
            L = BucketLayout(numels, offsets, ["a", "b", "c", "d"], layout_world, 0, 128, scaling, n, dtype, "cuda")
            res = L.ensure_residual() if ef else None
            if res is not None:
                res.copy_(data("gauss", L.padded_numel, seed=100 + case).cuda() * 1e-2)
            flat = x.clone()
            collectives.nccl_fp8(flat, L, codec, pre_scale=pre_scale, residual=res)
            torch.cuda.synchronize()
            out[name] = (flat, L.fp8_wire.clone(), L.fp8_scale_inv.clone(), int(L.saturated_last),
                         None if res is None else res.clone())
        (ft, wt, st, nt, rt), (fr, wr, sr, nr, rr) = out["torch"], out["triton"]
        torch.testing.assert_close(fr, ft, rtol=0, atol=0, equal_nan=True, msg=f"mean, case {case}")
        torch.testing.assert_close(sr, st, rtol=0, atol=0, equal_nan=True, msg=f"scale_inv, case {case}")
        finite = torch.isfinite(st).repeat_interleave(wt.numel() // st.numel()) if scaling == "block" else None
        if finite is not None:
            assert torch.equal(wr.view(-1)[finite], wt.view(-1)[finite]), f"wire, case {case}"
        elif not inf:
            assert torch.equal(wr, wt), f"wire, case {case}"
        assert nr == nt, (case, nr, nt)
        saw_saturation |= nt > 0
        if ef:
            torch.testing.assert_close(rr, rt, rtol=0, atol=0, msg=f"residual, case {case}")
            assert torch.isfinite(rr).all()
    assert saw_saturation, "no case saturated: the count was not exercised"
