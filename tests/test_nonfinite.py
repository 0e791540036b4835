"""A non-finite gradient step leaves no trace in error-feedback state (CPU, torch codec, gloo worlds
2 and 3): through ``all_reduce``, the DDP hook, FSDP1 and FSDP2; a GradScaler training with one
injected Inf; the residual rescaled when the loss scale changes; non-finite residuals in a loaded
state_dict cleaned; saturation counted only in finite scale groups.

The rule under test (``docs/numerics.md``): a residual element whose update comes out non-finite
keeps the value it had before the step.
"""
import logging
import math

import pytest
import torch

import nonfinite_checks as nc
from dist_harness import run_world, values
from fp8_comm_hook import FP8CommConfig, FP8CommState

DEV = torch.device("cpu")
EF_ERR_BOUND = 0.08          # two_shot with error feedback, one step against the exact mean
SCALINGS = ("block", "tensor", "bucket")
# GradScaler training: powers of two, so the scale moves (halving on the Inf, growth) are exact.
SCALE_RUNS = {"constant": [2.0 ** 10] * 6, "changing": [2.0 ** 10, 2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 11, 2.0 ** 11]}


def chk_all_reduce(rank, W):
    return {(scaling, ef, inject): nc.all_reduce_run(rank, W, DEV, "torch", scaling, ef, inject)
            for scaling in SCALINGS for ef in (False, True) for inject in (False, True)}


def chk_ddp(rank, W):
    return {(ef, inject): nc.ddp_run(rank, W, DEV, "torch", ef, inject) for ef in (False, True) for inject in (False, True)}


def chk_fsdp(rank, W):
    return {(kind, inject): nc.fsdp_run(rank, W, DEV, "torch", kind, inject)
            for kind in ("FULL_SHARD", "NO_SHARD", "fsdp2") for inject in (False, True)}


def chk_gradscaler(rank, W):
    return {(ef, inject): nc.gradscaler_run(rank, W, DEV, "torch", ef, inject)
            for ef in (False, True) for inject in (False, True)}


def chk_loss_scale(rank, W):
    out = {name: nc.loss_scale_run(rank, W, DEV, "torch", s) for name, s in SCALE_RUNS.items()}
    out["changing_not_told"] = nc.loss_scale_run(rank, W, DEV, "torch", SCALE_RUNS["changing"],
                                                 call_set_loss_scale=False)
    return out


def chk_accelerate_follows_scale(rank, W):
    """register_accelerate_hook with an fp16 accelerator (its GradScaler): every forward tells the
    state the scaler's scale, so a scale change rescales the residuals."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp8_comm_hook.integrations.accelerate import register_accelerate_hook

    class Fp16Accelerator:  # what register_accelerate_hook reads of an Accelerator
        distributed_type = "MULTI_CPU"
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)

    acc = Fp16Accelerator()
    acc.scaler.scale(torch.ones(()))  # the scaler's scale tensor exists from its first use
    net = nc.mlp(depth=3, width=32)
    d = DDP(net, bucket_cap_mb=0.02)
    st = register_accelerate_hook(acc, d, FP8CommConfig(min_compress_numel=0, error_feedback=True))
    x, y = nc._batch(rank, 0, DEV)
    torch.nn.functional.cross_entropy(d(x), y).backward()
    first = (st.loss_scale, {k: v.clone() for k, v in st.residuals().items()})
    acc.scaler.update(new_scale=2.0 ** 11)
    d(x)
    halved = all(torch.equal(v, first[1][k] / 2) for k, v in st.residuals().items())
    return dict(first_scale=first[0], scale=st.loss_scale, halved=halved, n=len(first[1]))


CHECKS = [chk_all_reduce, chk_ddp, chk_fsdp, chk_gradscaler, chk_loss_scale, chk_accelerate_follows_scale]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world(request):
    return request.param, run_world(request.param, CHECKS)


# ---------------------------------------------------------------------------------- assertions shared with the GPU suite
def assert_recovers(per_rank, clean_per_rank=None, bound=EF_ERR_BOUND, inf_nonfinite=True):
    """After the Inf step every rank's result is finite, within ``bound`` of the exact mean (and within
    1.5x the error of the same step of the clean run, when given), and bit-identical across ranks;
    the Inf step itself is non-finite on every rank."""
    for step in range(nc.STEPS):
        digests = {r["steps"][step]["digest"] for r in per_rank}
        assert len(digests) == 1, f"step {step}: results differ across ranks"
        for rank, r in enumerate(per_rank):
            s = r["steps"][step]
            nonfinite = s["nonfinite"] if "nonfinite" in s else int(not s["finite"])
            if step == nc.INF_STEP and inf_nonfinite:
                assert nonfinite > 0, f"rank {rank}: the Inf step came out finite"
                continue
            assert nonfinite == 0, f"rank {rank} step {step}: {nonfinite} non-finite values after the Inf step"
            assert s["err"] < bound, (rank, step, s["err"])
            if clean_per_rank is not None:
                clean = clean_per_rank[rank]["steps"][step]["err"]
                assert s["err"] <= 1.5 * clean + 1e-3, (rank, step, s["err"], clean)


def assert_gradscaler(per_rank, inf_step=5):
    """The scaler skips exactly the Inf step (on every rank), halves its scale once, and the loss
    afterwards follows the same-seed run without the Inf as closely with error feedback as without."""
    dev = {}
    for ef in (False, True):
        clean, hit = per_rank[0][(ef, False)], per_rank[0][(ef, True)]
        assert len({r[(ef, True)]["digest"] for r in per_rank}) == 1, "weights differ across ranks"
        for r in per_rank:
            run = r[(ef, True)]
            assert run["moved"] == [step != inf_step for step in range(len(run["moved"]))], run["moved"]
            assert run["residuals_finite"]
            assert all(math.isfinite(v) for v in run["losses"]), run["losses"]
        assert hit["scales"][inf_step] == clean["scales"][inf_step] / 2
        assert all(clean["moved"])
        after = range(inf_step + 1, len(clean["losses"]))
        dev[ef] = max(abs(hit["losses"][s] - clean["losses"][s]) / clean["losses"][s] for s in after)
    assert dev[True] <= 1.5 * dev[False] + 2e-3, dev
    return dev


def assert_loss_scale(per_rank):
    """Unscaled averaged gradients are bit-identical across a loss-scale change when the state is
    told (the residual follows the scale), and not when it is not."""
    for r in per_rank:
        assert r["changing"] == r["constant"], [a == b for a, b in zip(r["changing"], r["constant"])]
        assert r["changing_not_told"][:2] == r["constant"][:2]
        assert r["changing_not_told"][2:] != r["constant"][2:]


# ---------------------------------------------------------------------------------- tests in the world
@pytest.mark.parametrize("scaling", SCALINGS)
def test_all_reduce_recovers_after_inf(world, scaling):
    per_rank = values(world[1], "chk_all_reduce")
    without_ef = [r[(scaling, False, True)] for r in per_rank]
    assert_recovers(without_ef, [r[(scaling, False, False)] for r in per_rank], bound=0.05)
    with_ef = [r[(scaling, True, True)] for r in per_rank]
    assert_recovers(with_ef, [r[(scaling, True, False)] for r in per_rank])
    # the Inf's block keeps rank 0's residual from before the step; every residual stays finite
    r0 = with_ef[0]["residuals"]
    assert all(bool(torch.isfinite(res).all()) for r in with_ef for res in r["residuals"])
    block = slice(0, 128) if scaling == "block" else slice(0, 5000)
    if scaling == "block":
        assert torch.equal(r0[nc.INF_STEP][block], r0[nc.INF_STEP - 1][block])
        assert not torch.equal(r0[nc.INF_STEP][128:], r0[nc.INF_STEP - 1][128:])
    else:  # one scale group covers rank 0's whole destination chunk holding element 5
        W = world[0]
        chunk = -(-5000 // (W * 128)) * 128
        assert torch.equal(r0[nc.INF_STEP][:chunk], r0[nc.INF_STEP - 1][:chunk])


def test_ddp_recovers_after_inf(world):
    per_rank = values(world[1], "chk_ddp")
    assert_recovers([r[(False, True)] for r in per_rank], [r[(False, False)] for r in per_rank], bound=0.05)
    hit = [r[(True, True)] for r in per_rank]
    assert_recovers(hit, [r[(True, False)] for r in per_rank])
    for r in hit:
        assert r["residuals_finite"] and r["stats"]["nonfinite_buckets"] >= 1


@pytest.mark.parametrize("kind", ["FULL_SHARD", "NO_SHARD", "fsdp2"])
def test_fsdp_recovers_after_inf(world, kind):
    per_rank = values(world[1], "chk_fsdp")
    hit = [r[(kind, True)] for r in per_rank]
    assert_recovers(hit, [r[(kind, False)] for r in per_rank])
    assert all(r["residuals_finite"] for r in hit)
    # a reduce-scatter counts a non-finite block on the shard's owner only
    assert sum(r["stats"]["nonfinite_buckets"] for r in hit) >= 1


def test_gradscaler_training_with_inf(world):
    dev = assert_gradscaler(values(world[1], "chk_gradscaler"))
    print(f"world {world[0]}: max relative loss deviation after the skipped step: {dev}")


def test_residual_follows_loss_scale(world):
    assert_loss_scale(values(world[1], "chk_loss_scale"))


def test_accelerate_hook_follows_loss_scale(world):
    for r in values(world[1], "chk_accelerate_follows_scale"):
        assert r["first_scale"] == 2.0 ** 12 and r["scale"] == 2.0 ** 11 and r["halved"] and r["n"] > 0, r


# ---------------------------------------------------------------------------------- single-process units
def _loaded_state(value=8.0):
    st = FP8CommState(FP8CommConfig(error_feedback=True))
    st.load_state_dict(_state_with_residuals({"w": torch.full((4,), value)}))
    return st


def test_lightning_strategy_follows_loss_scale():
    pytest.importorskip("lightning", reason="lightning not installed (pip install lightning)")
    from lightning.pytorch.plugins.precision import MixedPrecision
    from fp8_comm_hook.integrations.lightning import FP8DDPStrategy

    strategy = FP8DDPStrategy(FP8CommConfig(error_feedback=True))
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=64.0))
    strategy._ddp_comm_state = st = _loaded_state()
    strategy.precision_plugin.scaler.scale(torch.ones(()))
    strategy.pre_backward(torch.tensor(1.0))
    assert st.loss_scale == 64.0
    strategy.precision_plugin.scaler.update(new_scale=16.0)
    strategy.pre_backward(torch.tensor(1.0))
    assert st.loss_scale == 16.0 and torch.equal(st.residuals()["w"], torch.full((4,), 2.0))
    # bf16-mixed has no scaler: nothing to follow
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    strategy.pre_backward(torch.tensor(1.0))
    assert st.loss_scale == 16.0


def test_transformers_callback_follows_loss_scale():
    pytest.importorskip("transformers", reason="transformers not installed (pip install transformers)")
    from fp8_comm_hook.integrations.transformers import FP8CommCallback

    class Trainer:  # what the callback reads of a transformers.Trainer
        class accelerator:
            scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    cb = FP8CommCallback(Trainer(), FP8CommConfig(error_feedback=True))
    cb.on_step_begin(None, None, None)           # not registered yet: nothing to do
    cb.state = st = _loaded_state()
    Trainer.accelerator.scaler.scale(torch.ones(()))
    cb.on_step_begin(None, None, None)
    Trainer.accelerator.scaler.update(new_scale=1024.0)
    cb.on_step_begin(None, None, None)
    assert st.loss_scale == 1024.0 and torch.equal(st.residuals()["w"], torch.full((4,), 32.0))


def test_follow_grad_scaler_ignores_missing_or_disabled_scaler():
    st = _loaded_state()
    assert st.follow_grad_scaler(None) == 1.0 and st.loss_scale is None
    assert st.follow_grad_scaler(torch.amp.GradScaler("cpu", enabled=False)) == 1.0 and st.loss_scale is None
def _state_with_residuals(residuals, world_size=2):
    return {"version": 1, "step": 3, "world_size": world_size, "config": FP8CommConfig().to_dict(),
            "keyed_by": "name", "stats": {}, "residuals": residuals}


def test_load_state_dict_cleans_nonfinite_residuals(caplog):
    good = torch.linspace(-1, 1, 300)
    bad = good.clone()
    bad[[3, 100, 299]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    st = FP8CommState(FP8CommConfig(error_feedback=True))
    with caplog.at_level(logging.WARNING, logger="fp8_comm_hook"):
        st.load_state_dict(_state_with_residuals({"a.weight": bad, "b.weight": good}))
    res = st.residuals()
    expect = bad.clone()
    expect[[3, 100, 299]] = 0.0
    assert torch.equal(res["a.weight"], expect) and torch.equal(res["b.weight"], good)
    assert "a.weight" in caplog.text and "3 non-finite" in caplog.text and "b.weight" not in caplog.text


def test_set_loss_scale_rescales_residuals():
    st = FP8CommState(FP8CommConfig(error_feedback=True))
    st.load_state_dict(_state_with_residuals({"w": torch.full((10,), 3.0)}))
    assert st.set_loss_scale(1024.0) == 1.0                 # the first value only records the scale
    assert st.set_loss_scale(1024.0) == 1.0
    assert st.set_loss_scale(512.0) == 0.5
    assert torch.equal(st.residuals()["w"], torch.full((10,), 1.5))
    assert st.loss_scale == 512.0 and st.state_dict()["loss_scale"] == 512.0
    st.rescale_residuals(4.0)
    assert torch.equal(st.residuals()["w"], torch.full((10,), 6.0))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            st.set_loss_scale(bad)
        with pytest.raises(ValueError, match="factor"):
            st.rescale_residuals(bad)
    # a restored state remembers the scale its residuals are in
    sd = {**_state_with_residuals(st.residuals()), "loss_scale": st.state_dict()["loss_scale"]}
    st2 = FP8CommState(FP8CommConfig(error_feedback=True))
    st2.load_state_dict(sd)
    assert st2.loss_scale == 512.0 and st2.set_loss_scale(1024.0) == 2.0
    assert torch.equal(st2.residuals()["w"], torch.full((10,), 12.0))


def test_saturation_counts_only_finite_groups():
    """A group whose scale_inv is NaN (it held an Inf) is not counted as saturated, so one Inf does
    not halve the automatic pre_scale."""
    from fp8_comm_hook.collectives import count_saturated
    from fp8_comm_hook.formats import get_format

    fmt = get_format("e4m3")
    q = torch.zeros(2, 256)
    q[0, :3] = fmt.fmax           # finite group: 3 saturated values
    q[1, 128:140] = -fmt.fmax     # this block's scale is NaN: not counted
    wire = q.to(fmt.dtype).view(torch.uint8)
    sinv = torch.tensor([[0.5, 1.0], [1.0, float("nan")]])
    deq = (q.view(2, 2, 128) * sinv[..., None]).view(-1)
    assert int(count_saturated(wire, deq, fmt)) == 3
