"""all_reduce and the DDP hook in gloo worlds of 2, 3 and 4 ranks, against the exact fp64 mean.

One world per size is spawned for the whole module; every check runs inside it.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from codec_ref import data
from ddp_checks import CFG0, batch, digest, exact_mean, local_grads, mlp, rel_err
from dist_harness import run_world, values
from fp8_comm_hook import FP8CommConfig, all_reduce, register_ddp_hook

# Two quantizations (contribution, then the owner's mean): ~0.036 for E4M3, ~0.073 for E5M2.
TWO_SHOT_BOUND = {"e4m3": 0.045, "e5m2": 0.09}
TWO_SHOT_FLOOR = {"e4m3": 0.028, "e5m2": 0.055}


# ---------------------------------------------------------------------------------------- checks
def chk_all_reduce_error(rank, W):
    out = {}
    for fmt in ("e4m3", "e5m2"):
        for kind in ("gauss", "student_t", "outliers"):
            for scaling in ("block", "tensor", "bucket"):
                x = data(kind, 100_003, seed=100 + rank)
                ref = exact_mean(x)
                y = all_reduce(x.clone(), FP8CommConfig(fp8_format=fmt, scaling=scaling, **CFG0))
                out[(fmt, kind, scaling)] = (rel_err(y, ref), digest([y]))
    return out


def chk_all_reduce_edge_sizes(rank, W):
    out = {}
    for n in (0, 1, W - 1, 127, 1000):
        x = data("gauss", n, seed=rank) if n else torch.zeros(0)
        ref = exact_mean(x)
        y = all_reduce(x.clone(), FP8CommConfig(**CFG0))
        out[n] = (y.shape == x.shape, rel_err(y, ref) if n else 0.0, digest([y]))
    x = torch.zeros(3000)
    out["zeros"] = bool(torch.equal(all_reduce(x, FP8CommConfig(**CFG0)), torch.zeros(3000)))
    # a 2-D bf16 tensor, averaged in place
    t = data("gauss", 12 * 77, seed=rank).view(12, 77).bfloat16()
    ref = exact_mean(t)
    r = all_reduce(t, FP8CommConfig(**CFG0))
    out["bf16"] = (r is t, r.dtype == torch.bfloat16, rel_err(t, ref))
    # below min_compress_numel: the plain path, exact
    x = data("gauss", 500, seed=rank)
    ref = exact_mean(x)
    out["small_exact"] = rel_err(all_reduce(x.clone(), FP8CommConfig(min_compress_numel=1000)), ref)
    return out


def chk_nonfinite_all_reduce(rank, W):
    out = {}
    for bad in (float("inf"), float("nan")):
        x = data("gauss", 5000, seed=rank)
        if rank == W - 1:
            x[4321] = bad
        y = all_reduce(x, FP8CommConfig(**CFG0))
        out[str(bad)] = (int((~torch.isfinite(y)).sum()), bool(torch.isfinite(y[:4000]).all()))
    return out


def _hooked(model, cfg=None, **ddp_kw):
    d = DDP(model, **ddp_kw)
    st = register_ddp_hook(d, FP8CommConfig(**{**CFG0, **(cfg or {})}))
    return d, st


def chk_grads_match_exact_mean(rank, W):
    """Gradients after the hook vs the exact fp64 mean, over several iterations (bucket rebuilds
    happen after iteration 0, or 1 with static_graph), for each DDP mode."""
    out = {}
    variants = {
        "default": dict(),
        "tiny_buckets": dict(bucket_cap_mb=0.02),
        "grad_as_bucket_view": dict(gradient_as_bucket_view=True, bucket_cap_mb=0.05),
        "static_graph": dict(static_graph=True, bucket_cap_mb=0.05),
        "find_unused": dict(find_unused_parameters=True, bucket_cap_mb=0.05),
    }
    for name, kw in variants.items():
        ref_model = mlp(depth=8, width=128, unused=(name == "find_unused"))
        model = copy.deepcopy(ref_model)
        d, st = _hooked(model, **kw)
        errs = []
        for it in range(4):
            x, y = batch(rank, it)
            ref = local_grads(ref_model, x, y)
            got = local_grads(d, x, y)
            for pname, g in ref.items():
                if g is None:  # the unused module: DDP leaves its gradient unset or zero
                    gg = got["module." + pname] if "module." + pname in got else got[pname]
                    assert gg is None or torch.count_nonzero(gg) == 0, pname
                    continue
                mean = exact_mean(g)
                errs.append(rel_err(dict(d.module.named_parameters())[pname].grad, mean))
        out[name] = dict(max_err=max(errs), layouts_built=st.layouts_built, stats=st.stats(),
                         digest=digest([p.grad for p in d.parameters() if p.grad is not None]))
    return out


def chk_no_sync_accumulates(rank, W):
    ref_model = mlp()
    d, st = _hooked(copy.deepcopy(ref_model))
    x1, y1 = batch(rank, 1)
    x2, y2 = batch(rank, 2)
    with d.no_sync():
        nn.functional.cross_entropy(d(x1), y1).backward()
    nn.functional.cross_entropy(d(x2), y2).backward()
    g1, g2 = local_grads(ref_model, x1, y1), local_grads(ref_model, x2, y2)
    errs = [rel_err(p.grad, exact_mean(g1[n] + g2[n])) for n, p in d.module.named_parameters()]
    return max(errs), st.stats()["steps"]


def chk_bf16_params(rank, W):
    ref_model = mlp().to(torch.bfloat16)
    d, st = _hooked(copy.deepcopy(ref_model), bucket_cap_mb=0.02)
    x, y = batch(rank, 0, dtype=torch.bfloat16)
    ref = local_grads(ref_model, x, y)
    local_grads(d, x, y)
    errs = [rel_err(p.grad, exact_mean(ref[n])) for n, p in d.module.named_parameters()]
    dtypes = {p.grad.dtype for p in d.parameters()}
    return max(errs), dtypes, st.stats()


def chk_training(rank, W):
    """40 SGD steps: loss falls, parameters bit-identical on every rank, bytes ratio."""
    torch.manual_seed(0)
    model = mlp(depth=4, width=256)
    d, st = _hooked(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(d.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(256, 40, generator=g)
    w = torch.randn(40, 10, generator=g)
    ys = (xs @ w).argmax(1)
    losses = []
    for step in range(40):
        idx = torch.arange(32) + 32 * ((step * W + rank) % 8)
        loss = nn.functional.cross_entropy(d(xs[idx]), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        full = nn.functional.cross_entropy(d.module(xs), ys).detach().clone()
        losses.append(full.item())
    s = st.stats()
    return dict(first=losses[0], last=losses[-1], digest=digest(list(model.parameters())), stats=s)


def chk_nonfinite_ddp(rank, W):
    d, st = _hooked(mlp(), bucket_cap_mb=0.02)
    x, y = batch(rank, 0)
    if rank == 0:
        x[0, 0] = float("inf")
    nn.functional.cross_entropy(d(x), y).backward()
    n_bad = sum(int((~torch.isfinite(p.grad)).sum()) for p in d.parameters())
    return n_bad, st.stats()["nonfinite_buckets"]


def chk_warmup_exact_then_compressed(rank, W):
    ref_model = mlp()
    d, st = _hooked(copy.deepcopy(ref_model), cfg=dict(warmup_steps=2))
    errs = []
    for it in range(3):
        x, y = batch(rank, it)
        ref = local_grads(ref_model, x, y)
        local_grads(d, x, y)
        errs.append(max(rel_err(p.grad, exact_mean(ref[n])) for n, p in d.module.named_parameters()))
    return errs, st.stats()


def chk_bad_registrations(rank, W):
    out = {}
    d = DDP(mlp())
    try:
        register_ddp_hook(d, FP8CommConfig(algorithm="nccl_fp8"))
        out["nccl_fp8"] = "no error"
    except ValueError as e:
        out["nccl_fp8"] = str(e)
    try:
        all_reduce(torch.ones(10), FP8CommConfig(algorithm="nccl_fp8"))
        out["nccl_fp8_all_reduce"] = "no error"
    except ValueError as e:
        out["nccl_fp8_all_reduce"] = str(e)
    register_ddp_hook(d, FP8CommConfig())
    try:
        register_ddp_hook(d, FP8CommConfig())
        out["twice"] = "no error"
    except RuntimeError as e:
        out["twice"] = str(e)
    try:
        register_ddp_hook(DDP(mlp()), FP8CommConfig(block_size=64 if rank == 0 else 128))
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


CHECKS = [chk_all_reduce_error, chk_all_reduce_edge_sizes, chk_nonfinite_all_reduce, chk_grads_match_exact_mean,
          chk_no_sync_accumulates, chk_bf16_params, chk_training, chk_nonfinite_ddp,
          chk_warmup_exact_then_compressed, chk_bad_registrations]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world(request):
    return request.param, run_world(request.param, CHECKS)


def all_same(vals):
    return all(v == vals[0] for v in vals)


# ---------------------------------------------------------------------------------------- tests
def test_all_reduce_error_and_bitwise_agreement(world):
    W, res = world
    per_rank = values(res, "chk_all_reduce_error")
    for key, (err, _) in per_rank[0].items():
        fmt, kind, scaling = key
        assert all_same([r[key][1] for r in per_rank]), f"ranks disagree for {key}"
        assert err < TWO_SHOT_BOUND[fmt] * (1.6 if scaling != "block" else 1.0), (key, err)
        if kind == "gauss" and scaling == "block":
            assert err > TWO_SHOT_FLOOR[fmt], (key, err)  # two roundings happened, not zero or one


def test_all_reduce_edge_sizes(world):
    W, res = world
    per_rank = values(res, "chk_all_reduce_edge_sizes")
    for n in (0, 1, W - 1, 127, 1000):
        shape_ok, err, _ = per_rank[0][n]
        assert shape_ok and err < 0.05, (n, err)
        assert all_same([r[n][2] for r in per_rank])
    assert per_rank[0]["zeros"]
    same, dtype_ok, err = per_rank[0]["bf16"]
    assert same and dtype_ok and err < 0.05
    assert per_rank[0]["small_exact"] < 1e-6


def test_nonfinite_reaches_every_rank(world):
    W, res = world
    for r in values(res, "chk_nonfinite_all_reduce"):
        for bad, (n_nonfinite, rest_finite) in r.items():
            assert n_nonfinite >= 1 and rest_finite, (bad, n_nonfinite)


def test_ddp_grads_match_exact_mean(world):
    W, res = world
    per_rank = values(res, "chk_grads_match_exact_mean")
    for name, r0 in per_rank[0].items():
        assert r0["max_err"] < TWO_SHOT_BOUND["e4m3"] * 1.3, (name, r0["max_err"])
        assert all_same([r[name]["digest"] for r in per_rank]), name
        assert r0["stats"]["compressed_buckets"] >= 4
        assert r0["stats"]["steps"] == 4
    assert per_rank[0]["tiny_buckets"]["layouts_built"] >= 8  # many buckets, each with its layout


def test_ddp_no_sync(world):
    W, res = world
    for err, steps in values(res, "chk_no_sync_accumulates"):
        assert err < 0.06 and steps == 1


def test_ddp_bf16_params(world):
    W, res = world
    for err, dtypes, stats in values(res, "chk_bf16_params"):
        assert dtypes == {torch.bfloat16}
        assert err < 0.06
        # baseline counts bf16 bytes: fp8 + block scales is ~half of it
        assert 0.45 < stats["bytes_sent"] / stats["bytes_baseline"] < 0.6


def test_ddp_training(world):
    W, res = world
    per_rank = values(res, "chk_training")
    assert all_same([r["digest"] for r in per_rank]), "parameters differ across ranks"
    r0 = per_rank[0]
    assert r0["last"] < 0.3 * r0["first"]
    s = r0["stats"]
    assert s["steps"] == 40 and s["compressed_buckets"] > 40
    ratio = s["bytes_sent"] / s["bytes_baseline"]
    assert 0.24 < ratio <= 0.30, ratio


def test_ddp_nonfinite_on_every_rank(world):
    W, res = world
    for n_bad, counted in values(res, "chk_nonfinite_ddp"):
        assert n_bad > 0 and counted > 0


def test_warmup_steps_are_exact(world):
    W, res = world
    for errs, stats in values(res, "chk_warmup_exact_then_compressed"):
        assert errs[0] < 1e-6 and errs[1] < 1e-6 and errs[2] > 1e-3
        assert stats["uncompressed_buckets"] >= 2 and stats["compressed_buckets"] >= 1


def test_bad_registrations(world):
    W, res = world
    for r in values(res, "chk_bad_registrations"):
        assert "nccl_fp8' needs NCCL on an sm90+ GPU" in r["nccl_fp8"]
        assert "needs NCCL on an sm90+ GPU" in r["nccl_fp8_all_reduce"]
        assert "already registered" in r["twice"]
        assert "block_size" in r["mismatch"]
