"""Checks of a non-finite gradient step under error feedback, shared by the CPU suite
(``test_nonfinite.py``) and the GPU suite (``test_gpu_nonfinite.py``, CUDA tensors and the GPU codecs).

The injected fault is what a mixed-precision overflow looks like: at one step, on one rank, one
element of the first layer's output gradient is +Inf, so one row of that layer's weight gradient
and one bias element are non-finite (the rest of the model is untouched). Each check returns plain
data; the assertions live in the test modules, where every rank's values are visible.
"""
import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

from codec_ref import data
from ddp_checks import digest, exact_mean, mlp, rel_err  # noqa: F401 (mlp: used by the test modules too)

INF_STEP = 1          # the step whose gradient holds the Inf
STEPS = 4
_RUNS = itertools.count(1)   # the same sequence on every rank: a fresh all_reduce state per run


class _InjectInf(torch.autograd.Function):
    """Identity forward; backward puts +Inf into element [0, 5] of the output gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[0, 5] = float("inf")
        return g


class InfInjector:
    """A forward hook on ``module`` that makes its output gradient non-finite while ``armed``."""

    def __init__(self, module: nn.Module):
        self.armed = False
        module.register_forward_hook(lambda m, i, o: _InjectInf.apply(o) if self.armed else o)


def _batch(rank, step, device):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 40, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    return x.to(device), y.to(device)


def _grads(model, x, y, names=None):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x).float(), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _summary(got, ref_local):
    """Relative L2 error of all gradients against the exact fp64 mean, finiteness, digest."""
    names = sorted(ref_local)
    g = torch.cat([got[n].double().flatten() for n in names])
    r = torch.cat([exact_mean(ref_local[n]).flatten() for n in names])
    finite = bool(torch.isfinite(g).all())
    return dict(finite=finite, err=rel_err(g, r) if finite else float("nan"), digest=digest([got[n] for n in names]))


# ---------------------------------------------------------------------------------- all_reduce
def all_reduce_run(rank, W, device, backend, scaling, error_feedback, inject=True):
    """The reproduction of the issue through ``fp8_comm_hook.all_reduce``: four steps of seeded
    Gaussian data, +Inf at step 1 in rank 0's element 5. Per step: non-finite count, relative error
    against the exact mean, digest; and this rank's residual (from the state) after steps 0 and 1."""
    from fp8_comm_hook import FP8CommConfig, all_reduce
    from fp8_comm_hook.reduce import _ALL_REDUCE_STATES

    # ``seed`` (unused without stochastic rounding) makes the cached all_reduce state fresh per run.
    cfg = FP8CommConfig(error_feedback=error_feedback, min_compress_numel=0, scaling=scaling, backend=backend,
                        seed=next(_RUNS))
    state = None
    out = []
    residuals = []
    for step in range(STEPS):
        x = data("student_t", 5000, seed=10 * step + rank).to(device)
        ref = exact_mean(x)
        if inject and step == INF_STEP and rank == 0:
            x[5] = float("inf")
        y = all_reduce(x, cfg)
        finite = torch.isfinite(y)
        out.append(dict(nonfinite=int((~finite).sum()), err=rel_err(y, ref) if bool(finite.all()) else None,
                        digest=digest([y])))
        state = state or _ALL_REDUCE_STATES[(cfg.replace(warmup_steps=0), None)]
        res = state.residuals()
        residuals.append(next(iter(res.values())).clone() if res else None)
    return dict(steps=out, residuals=residuals)


# ---------------------------------------------------------------------------------- DDP
def ddp_run(rank, W, device, backend, error_feedback, inject=True, bucket_cap_mb=0.02):
    """DDP with the FP8 hook, error feedback, small buckets: four backward passes, the Inf at step 1
    on rank 0. Per step the summary of the averaged gradients; the residuals' finiteness at the end."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp8_comm_hook import FP8CommConfig, register_ddp_hook

    ref = mlp(depth=4, width=64).to(device)
    net = copy.deepcopy(ref)
    inj = InfInjector(net[0])
    d = DDP(net, bucket_cap_mb=bucket_cap_mb)
    st = register_ddp_hook(d, FP8CommConfig(min_compress_numel=0, error_feedback=error_feedback, backend=backend))

    def averaged(x, y):
        return {n[len("module."):]: g for n, g in _grads(d, x, y).items()}

    return _run_steps(rank, device, ref, averaged, inj, inject, st)


def _run_steps(rank, device, ref, averaged_grads, inj, inject, state):
    """``STEPS`` backward passes of the plain ``ref`` and of the wrapped model on this rank's
    batches, the Inf armed at ``INF_STEP`` on rank 0 when ``inject``; ``averaged_grads(x, y)`` runs
    the wrapped model's backward and returns its full averaged gradients by parameter name."""
    out = []
    for step in range(STEPS):
        x, y = _batch(rank, step, device)
        loc = _grads(ref, x, y)
        inj.armed = inject and step == INF_STEP and rank == 0
        out.append(_summary(averaged_grads(x, y), loc))
    return dict(steps=out, residuals_finite=_finite(state.residuals().values()), stats=state.stats())


# ---------------------------------------------------------------------------------- FSDP
def _fsdp1(model, strategy, device):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, sharding_strategy=ShardingStrategy[strategy], use_orig_params=True, device_id=device,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _fsdp1_full_grads(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, with_grads=True):
        return {n.replace("_fsdp_wrapped_module.", ""): p.grad.detach().clone() for n, p in model.named_parameters()}


def _fsdp2(model, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_full_grads(model):
    return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def fsdp_run(rank, W, device, backend, kind, inject=True):
    """FSDP1 (FULL_SHARD, NO_SHARD) or FSDP2 with error feedback: four backward passes, the Inf at
    step 1 on rank 0; per step the summary of the full averaged gradients, and the residuals'
    finiteness at the end."""
    from fp8_comm_hook import FP8CommConfig, register_fsdp_hook

    device = torch.device(device)
    ref = mlp(depth=4, width=64).to(device)
    net = copy.deepcopy(ref)
    inj = InfInjector(net[0])
    if kind == "fsdp2":
        model, full = _fsdp2(net, device), _fsdp2_full_grads
    else:
        model, full = _fsdp1(net, kind, device), _fsdp1_full_grads
    st = register_fsdp_hook(model, FP8CommConfig(min_compress_numel=0, error_feedback=True, backend=backend))

    def averaged(x, y):
        _grads(model, x, y)
        return full(model)

    return _run_steps(rank, device, ref, averaged, inj, inject, st)


# ---------------------------------------------------------------------------------- GradScaler training
def gradscaler_run(rank, W, device, backend, error_feedback, inject, steps=24, inf_step=5, follow_scale=True):
    """SGD with momentum under ``torch.amp.GradScaler`` (fp32 weights; on CUDA under fp16 autocast),
    the FP8 hook, optionally error feedback, and optionally an Inf on rank 0 at ``inf_step``. The
    trainer tells the state the loss scale before every backward (``set_loss_scale``). Per step: the
    full-batch loss after the step, the loss scale, and whether the weights moved."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp8_comm_hook import FP8CommConfig, register_ddp_hook

    device = torch.device(device)
    net = mlp(depth=4, width=64).to(device)
    inj = InfInjector(net[0])
    d = DDP(net, bucket_cap_mb=0.02)
    st = register_ddp_hook(d, FP8CommConfig(min_compress_numel=0, error_feedback=error_feedback, backend=backend))
    opt = torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12, growth_interval=10_000)
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(256, 40, generator=g).to(device)
    ys = (xs.cpu() @ torch.randn(40, 10, generator=g)).argmax(1).to(device)
    autocast = torch.autocast("cuda", dtype=torch.float16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)

    def full_loss():
        with torch.no_grad():
            return nn.functional.cross_entropy(net(xs), ys).item()

    losses, scales, moved = [], [], []
    for step in range(steps):
        idx = torch.arange(32, device=device) + 32 * ((step * W + rank) % 8)
        if follow_scale:
            st.set_loss_scale(scaler.get_scale())
        before = [p.detach().clone() for p in net.parameters()]
        inj.armed = inject and step == inf_step and rank == 0
        with autocast:
            loss = nn.functional.cross_entropy(d(xs[idx]), ys[idx])
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        moved.append(not all(torch.equal(a, p) for a, p in zip(before, net.parameters())))
        scales.append(scaler.get_scale())
        losses.append(full_loss())
    return dict(losses=losses, scales=scales, moved=moved, residuals_finite=_finite(st.residuals().values()),
                digest=digest(list(net.parameters())))


# ---------------------------------------------------------------------------------- loss-scale rescaling
def loss_scale_run(rank, W, device, backend, scales, call_set_loss_scale=True):
    """DDP with error feedback where the loss is multiplied by ``scales[step]`` (powers of two, as a
    GradScaler's) and the averaged gradient divided by it again. Returns the digest of the unscaled
    averaged gradients per step: with the residual rescaled on every scale change these are
    bit-identical to a run at a constant scale (FP8 block scaling is exact under powers of two)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fp8_comm_hook import FP8CommConfig, register_ddp_hook

    device = torch.device(device)
    net = mlp(depth=4, width=64).to(device)
    d = DDP(net, bucket_cap_mb=0.02)
    st = register_ddp_hook(d, FP8CommConfig(min_compress_numel=0, error_feedback=True, backend=backend))
    opt = torch.optim.SGD(d.parameters(), lr=0.05)
    digests = []
    for step, s in enumerate(scales):
        if call_set_loss_scale:
            st.set_loss_scale(s)
        x, y = _batch(rank, step, device)
        opt.zero_grad()
        (nn.functional.cross_entropy(d(x), y) * s).backward()
        for p in net.parameters():
            p.grad.div_(s)
        digests.append(digest([p.grad for p in net.parameters()]))
        opt.step()
    return digests
