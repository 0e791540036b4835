"""Error feedback, stochastic rounding, checkpoint/resume, GradScaler, pickling: gloo worlds 2-4."""
import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from codec_ref import data
from ddp_checks import CFG0, batch, digest, exact_mean, local_grads, mlp, rel_err
from dist_harness import run_world, values
from fp8_comm_hook import FP8CommConfig, FP8CommState, all_reduce, register_ddp_hook


def _hooked(model, **cfg):
    d = DDP(model, bucket_cap_mb=cfg.pop("bucket_cap_mb", 0.05))
    return d, register_ddp_hook(d, FP8CommConfig(**{**CFG0, **cfg}))


def chk_error_feedback_average(rank, W):
    """Constant gradient, lr 0: the running average of the communicated gradient converges to the
    exact mean with error feedback; without it the same error repeats every step."""
    out = {}
    x, y = batch(rank, 0)
    ref_model = mlp()
    ref = local_grads(ref_model, x, y)
    mean = torch.cat([exact_mean(ref[n]).flatten() for n, _ in ref_model.named_parameters()])
    for ef in (False, True):
        d, st = _hooked(copy.deepcopy(ref_model), error_feedback=ef)
        acc = torch.zeros_like(mean)
        for _ in range(40):
            g = local_grads(d, x, y)
            acc += torch.cat([g["module." + n].double().flatten() for n, _ in ref_model.named_parameters()])
        out[ef] = rel_err(acc / 40, mean)
    return out


def chk_stochastic_rounding(rank, W):
    x = data("gauss", 20_000, seed=rank)
    ref = exact_mean(x)
    cfg = FP8CommConfig(stochastic_rounding=True, seed=3, **CFG0)
    runs = [all_reduce(x.clone(), cfg).double() for _ in range(64)]
    one = rel_err(runs[0], ref)
    avg = rel_err(torch.stack(runs).mean(0), ref)
    rne = FP8CommConfig(**CFG0)
    det = torch.equal(all_reduce(x.clone(), rne), all_reduce(x.clone(), rne))
    return dict(one=one, avg=avg, rne_deterministic=det, digest=digest([torch.stack(runs)]),
                differ=not torch.equal(runs[0], runs[1]))


def chk_ef_sr_tiny_buckets_bitwise(rank, W):
    torch.manual_seed(0)
    model = mlp(depth=5, width=128)
    d, st = _hooked(model, error_feedback=True, stochastic_rounding=True, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(d.parameters(), lr=0.05)
    for step in range(60):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(d(x), y).backward()
        opt.step()
    return digest(list(model.parameters())), st.stats()


def _train(d, opt, rank, steps, start):
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(d(x), y).backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def chk_checkpoint_resume(rank, W):
    cfg = dict(error_feedback=True, scaling="block")
    torch.manual_seed(0)
    model = mlp(depth=5, width=128)
    d, st = _hooked(model, **cfg)
    opt = torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)
    _train(d, opt, rank, 10, 0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comm": st.state_dict()}, buf)
    at_ckpt = _flat(model)
    _train(d, opt, rank, 10, 10)
    uninterrupted = _flat(model)
    resumed, sd_roundtrip = [], None
    for _ in range(2):
        buf.seek(0)
        ck = torch.load(buf, weights_only=True)
        m2 = mlp(depth=5, width=128, seed=123)
        m2.load_state_dict(ck["model"])
        d2, st2 = _hooked(m2, **cfg)
        st2.load_state_dict(ck["comm"])
        if sd_roundtrip is None:
            again = st2.state_dict()
            sd_roundtrip = (again["step"] == ck["comm"]["step"] and again["keyed_by"] == "name"
                            and again["residuals"].keys() == ck["comm"]["residuals"].keys()
                            and all(torch.equal(again["residuals"][k], v) for k, v in ck["comm"]["residuals"].items())
                            and len(again["residuals"]) > 0)
        opt2 = torch.optim.SGD(d2.parameters(), lr=0.1, momentum=0.9)
        opt2.load_state_dict(ck["opt"])
        _train(d2, opt2, rank, 10, 10)
        resumed.append(_flat(m2))
    travelled = (uninterrupted - at_ckpt).norm().item()
    return dict(resumes_equal=bool(torch.equal(resumed[0], resumed[1])), roundtrip=sd_roundtrip,
                rel_distance=(resumed[0] - uninterrupted).norm().item() / travelled,
                step=ck["comm"]["step"])


def chk_resume_other_world_drops_residuals(rank, W):
    d, st = _hooked(mlp(), error_feedback=True)
    x, y = batch(rank, 0)
    local_grads(d, x, y)
    sd = st.state_dict()
    sd["world_size"] = W + 1
    d2, st2 = _hooked(mlp(), error_feedback=True)
    st2.load_state_dict(sd)
    return len(st.residuals()) > 0, len(st2.residuals())


def chk_gradscaler_skips_on_every_rank(rank, W):
    torch.manual_seed(0)
    model = mlp()
    d, st = _hooked(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = batch(rank, 0)
    before = _flat(model)
    if rank == W - 1:
        x = x.clone()
        x[3, 7] = float("inf")
    opt.zero_grad()
    scaler.scale(nn.functional.cross_entropy(d(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    skipped = torch.equal(before, _flat(model))
    # and a finite step afterwards goes through everywhere
    x, y = batch(rank, 1)
    opt.zero_grad()
    scaler.scale(nn.functional.cross_entropy(d(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    return dict(skipped=skipped, scale=scaler.get_scale(), moved=not torch.equal(before, _flat(model)),
                nonfinite=st.stats()["nonfinite_buckets"], digest=digest(list(model.parameters())))


def chk_state_pickles_without_group(rank, W):
    d, st = _hooked(mlp(), error_feedback=True)
    x, y = batch(rank, 0)
    local_grads(d, x, y)
    st2 = pickle.loads(pickle.dumps(st))
    return (st2.config == st.config, st2.step == st.step, st2.process_group is None,
            set(st2.residuals()) == set(st.residuals()))


CHECKS = [chk_error_feedback_average, chk_stochastic_rounding, chk_ef_sr_tiny_buckets_bitwise, chk_checkpoint_resume,
          chk_resume_other_world_drops_residuals, chk_gradscaler_skips_on_every_rank, chk_state_pickles_without_group]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world(request):
    return request.param, run_world(request.param, CHECKS)


def test_error_feedback_average_converges(world):
    for r in values(world[1], "chk_error_feedback_average"):
        assert 0.025 < r[False] < 0.045, r  # the same error every step
        assert r[True] * 10 <= r[False], r


def test_stochastic_rounding(world):
    per_rank = values(world[1], "chk_stochastic_rounding")
    assert len({r["digest"] for r in per_rank}) == 1, "SR results differ across ranks"
    for r in per_rank:
        assert r["avg"] * 3 <= r["one"], r
        assert r["rne_deterministic"] and r["differ"]


def test_ef_sr_tiny_buckets_bitwise(world):
    per_rank = values(world[1], "chk_ef_sr_tiny_buckets_bitwise")
    assert len({d for d, _ in per_rank}) == 1
    assert per_rank[0][1]["steps"] == 60 and per_rank[0][1]["compressed_buckets"] >= 60 * 3


def test_checkpoint_resume(world):
    for r in values(world[1], "chk_checkpoint_resume"):
        assert r["roundtrip"] and r["step"] == 10
        assert r["resumes_equal"]
        assert r["rel_distance"] <= 0.05, r


def test_resume_at_other_world_size_drops_residuals(world):
    for had, kept in values(world[1], "chk_resume_other_world_drops_residuals"):
        assert had and kept == 0


def test_gradscaler_skips_on_every_rank(world):
    per_rank = values(world[1], "chk_gradscaler_skips_on_every_rank")
    assert len({r["digest"] for r in per_rank}) == 1
    for r in per_rank:
        assert r["skipped"] and r["moved"] and r["nonfinite"] >= 1
        assert r["scale"] == 2.0 ** 9


def test_state_pickles_without_group(world):
    for r in values(world[1], "chk_state_pickles_without_group"):
        assert all(r), r
