"""The one seam DDP and FSDP share: a flat gradient in, its mean (or this rank's shard of it) out.

:func:`reduce_flat` (all-reduce: the DDP hook, FSDP1 NO_SHARD and :func:`all_reduce`) and
:func:`reduce_scatter_flat` (FSDP1 sharded strategies, FSDP2) ask the state for the bucket's
:class:`~fp8_comm_hook.state.BucketPlan` in one call and run the wire algorithm it names from
:mod:`fp8_comm_hook.collectives`.
"""
from typing import Optional

import torch
import torch.distributed as dist

from . import collectives
from .config import FP8CommConfig
from .layout import LayoutSpec, PooledLayout
from .state import FP8CommState
from .stats import fp8_sum_bytes, ring_allreduce_bytes, two_shot_bytes

__all__ = ["reduce_flat", "reduce_bucket", "reduce_scatter_flat", "all_reduce"]


def reduce_flat(state: FP8CommState, flat: torch.Tensor, spec: LayoutSpec, async_op: bool):
    """Average ``flat`` over ``state``'s group with the algorithm the state picks for it; ``spec``
    describes the bucket's layout. Returns what the collective functions return (``(work, finish)``
    when ``async_op``, else ``flat``)."""
    return _dispatch(state, state.prepare(flat, spec), flat, async_op)


def _dispatch(state: FP8CommState, plan, flat: torch.Tensor, async_op: bool, group=None):
    group = group if group is not None else state.group
    rec = state.stats_recorder
    if plan.mode == "none":
        return collectives.plain_all_reduce(flat, group, stats=rec, async_op=async_op)
    if plan.mode == "bf16":
        return collectives.cast_all_reduce(flat, group, stats=rec, async_op=async_op, wire=_bf16_wire(plan, flat))
    if plan.mode == "nccl_fp8":
        return collectives.nccl_fp8(flat, plan.layout, plan.codec, group, pre_scale=state.config.pre_scale,
                                    stats=rec, residual=plan.residual, generator=plan.generator, async_op=async_op)
    return collectives.two_shot(flat, plan.layout, plan.codec, group, stats=rec, residual=plan.residual,
                                generator=plan.generator, async_op=async_op)


def _bf16_wire(plan, flat: torch.Tensor) -> Optional[torch.Tensor]:
    """The bf16 buffer ``auto``'s bf16 recipe casts a CPU bucket into, kept in the plan's memo so a
    bucket reuses it every step (on one CPU core a new 25 MB tensor took 15.5 ms to cast into, a
    kept one 2.8 ms: fresh pages fault). None (a new tensor per call, as torch's recipe does) on
    GPUs, whose caching allocator makes that free, and for one-off plans."""
    if plan.memo is None or flat.device.type != "cpu":
        return None
    wire = plan.memo.get("bf16_wire")
    if wire is None or wire.shape != flat.shape:
        wire = plan.memo["bf16_wire"] = torch.empty_like(flat, dtype=torch.bfloat16)
    return wire


def _graphable(state: FP8CommState, plan, flat: torch.Tensor) -> bool:
    """Whether this bucket's all-reduce can run as a captured CUDA graph (:mod:`fp8_comm_hook.graphs`):
    CUDA tensors over NCCL, round-to-nearest, a plan reused across steps; for the FP8 modes also a
    non-pooled layout and a codec without host state that changes per call (the Triton codec's
    tensor/bucket scaling passes a new amax epoch every call)."""
    cfg = state.config
    if not flat.is_cuda or state.backend != "nccl" or cfg.stochastic_rounding or plan.memo is None:
        return False
    if not state.bucket_graphs().enabled:
        return False
    if plan.layout is None:
        return True
    if isinstance(plan.layout, PooledLayout):
        return False
    name = getattr(plan.codec, "name", "")
    return name == "torch" or (name == "triton" and cfg.scaling == "block")


class _GraphOwner:
    """What a plain or bf16 bucket's graphs live and die with (an FP8 bucket's live with its layout)."""

    __slots__ = ("__weakref__",)


def _graph_runner(state: FP8CommState, plan, flat: torch.Tensor):
    """``run()`` for a graphable bucket: replays (or, the first times, runs and captures) the bucket's
    synchronous all-reduce on the communication stream and returns DDP's Future. Built once per
    plan and kept in the plan's ``memo`` under ``"graph_run"`` (which a bucket whose graph variant
    never changes replaces with the graphs' direct replayer once it is captured)."""
    memo = plan.memo
    group, rec, graphs = state.group, state.stats_recorder, state.bucket_graphs()
    L, codec, res, cfg, mode = plan.layout, plan.codec, plan.residual, state.config, plan.mode
    prepare_capture = lambda: rec.device_counters(flat.device)  # noqa: E731
    if mode == "none" or mode == "bf16":
        owner = _GraphOwner()
        W = state.world_size
        nbytes = ring_allreduce_bytes(flat.numel() * (flat.element_size() if mode == "none" else 2), W)
        if mode == "none":
            algorithm = lambda: collectives.plain_all_reduce(flat, group, stats=rec)  # noqa: E731
        else:
            algorithm = lambda: collectives.cast_all_reduce(flat, group, stats=rec)  # noqa: E731
        on_replay = lambda: rec.add("bytes_sent", nbytes)  # noqa: E731
        return _settling(graphs, memo, owner, flat, (mode,), algorithm, on_replay, prepare_capture)
    W = L.world_size
    if mode == "nccl_fp8":
        nbytes = fp8_sum_bytes(L.padded_numel, L.groups.num_groups, W)
        on_replay = lambda: rec.add("bytes_sent", nbytes)  # noqa: E731

        def run():
            # The automatic pre_scale is adapted here, on the host, from the last sum's saturation
            # count; each value it takes is a variant of the graph (it steadies at 1 or a halving of it).
            ps = cfg.pre_scale if cfg.pre_scale is not None else collectives.auto_pre_scale_step(L)

            def algorithm():
                return collectives.nccl_fp8(flat, L, codec, group, pre_scale=ps, stats=rec, residual=res)

            return graphs.run(L, flat, (mode, res is not None, ps), algorithm, on_replay, prepare_capture,
                              L.publish_saturation)

        return run
    nbytes = two_shot_bytes(L.chunk_bytes, W)
    on_replay = lambda: rec.add("bytes_sent", nbytes)  # noqa: E731
    algorithm = lambda: collectives.two_shot(flat, L, codec, group, stats=rec, residual=res)  # noqa: E731
    return _settling(graphs, memo, L, flat, (mode, res is not None), algorithm, on_replay, prepare_capture)


def _settling(graphs, memo: dict, owner, flat: torch.Tensor, variant: tuple, algorithm, on_replay, prepare_capture):
    """A runner for a bucket whose graph variant never changes: :meth:`BucketGraphs.run` until the
    graph is captured; then it puts the graphs' direct replayer (no lookups per call) in its place
    in ``memo``, so that later calls go straight to the replay."""

    def run():
        fut = graphs.run(owner, flat, variant, algorithm, on_replay, prepare_capture)
        replay = graphs.replayer(owner, flat, variant, on_replay)
        if replay is not None:
            memo["graph_run"] = replay
        return fut

    return run


def reduce_bucket(state: FP8CommState, flat: torch.Tensor, plan, last: bool = True) -> torch.futures.Future:
    """The DDP hook's form of :func:`reduce_flat`: average the bucket ``flat`` with ``plan`` (its
    :class:`~fp8_comm_hook.state.BucketPlan`, from :meth:`FP8CommState.prepare_bucket` or
    :meth:`FP8CommState.prepare`) and return a Future of it; ``last``: this is the step's last
    bucket. On CUDA with NCCL (see :func:`_graphable`) the
    bucket's whole all-reduce, FP8 or not, is replayed as a captured CUDA graph on a communication
    stream, and the last bucket makes the compute stream wait for that stream (before DDP reads
    the buckets); where the state has a communication worker (gloo, round-to-nearest), an FP8
    bucket's all-reduce runs on that thread, in bucket order, and this returns at once; otherwise
    the collectives are issued here, in bucket order, and the Future's callback finishes the
    bucket."""
    memo = plan.memo
    run = memo.get("graph_run") if memo is not None else None
    if run is None and _graphable(state, plan, flat):
        run = memo["graph_run"] = _graph_runner(state, plan, flat)
    if run is not None:
        fut = run()
        if last:
            state.bucket_graphs().join()
        return fut
    if last and flat.is_cuda:
        state.bucket_graphs().join()   # earlier buckets of this step may have run on the comm stream
    worker = state.worker
    if plan.layout is not None and worker is not None and not state.config.stochastic_rounding:
        side_group = worker[1]
        return worker[0].submit(lambda: _dispatch(state, plan, flat, async_op=False, group=side_group),
                                flat.device)
    work, finish = _dispatch(state, plan, flat, async_op=True)
    return work.get_future().then(lambda fut: finish())


def reduce_scatter_flat(state: FP8CommState, key: str, flat: torch.Tensor, out: torch.Tensor, group,
                        average: bool) -> torch.Tensor:
    """Reduce-scatter ``flat`` (W equal shards) into ``out`` (this rank's shard) over ``group`` with
    the algorithm the state picks: the mean when ``average``, else the sum. ``key`` names the flat
    gradient (residuals are kept per ``"<key>[r]"``). Returns ``out``; ``ValueError`` when ``out`` is
    not 1/W of ``flat``."""
    W = dist.get_world_size(group)
    flat = flat.view(-1)
    if out.numel() * W != flat.numel():
        raise ValueError(f"reduce-scatter output of {out.numel()} elements is not 1/{W} of the "
                         f"{flat.numel()}-element input")
    plan = state.prepare(flat, LayoutSpec.shards(key, flat.numel(), W, dist.get_rank(group)), "reduce_scatter")
    rec = state.stats_recorder
    if plan.mode == "none":
        return collectives.plain_reduce_scatter(flat, out, group, average=average, stats=rec)
    if plan.mode == "nccl_fp8":
        return collectives.nccl_fp8_reduce_scatter(flat, out, plan.layout, plan.codec, group, average=average,
                                                   pre_scale=state.config.pre_scale, stats=rec,
                                                   residual=plan.residual, generator=plan.generator)
    return collectives.fp8_reduce_scatter(flat, out, plan.layout, plan.codec, group, average=average, stats=rec,
                                          residual=plan.residual, generator=plan.generator)


_ALL_REDUCE_STATES = {}


def all_reduce(tensor: torch.Tensor, config: Optional[FP8CommConfig] = None, group=None) -> torch.Tensor:
    """Average ``tensor`` over ``group`` in place through the same FP8 machinery as the hook (the
    config's ``algorithm``, ``scaling`` and ``min_compress_numel`` apply; ``warmup_steps`` does not) and
    return it. Layouts are cached per (config, group, shape, dtype, device); with
    ``error_feedback=True`` the residual of a tensor of that shape carries over to the next call.

    Example::

        grad_norms = fp8_comm_hook.all_reduce(local_stats, FP8CommConfig(min_compress_numel=0))"""
    config = config if config is not None else FP8CommConfig()
    if not isinstance(config, FP8CommConfig):
        raise TypeError(f"config must be an FP8CommConfig or None, got {type(config).__name__}")
    if config.algorithm == "nccl_fp8":
        collectives.check_nccl_fp8_supported(group, tensor.device)
    key = (config.replace(warmup_steps=0), id(group) if group is not None else None)
    state = _ALL_REDUCE_STATES.get(key)
    if state is None:
        state = _ALL_REDUCE_STATES[key] = FP8CommState(key[0], group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    try:
        reduce_flat(state, flat, LayoutSpec.single(f"all_reduce:{tuple(tensor.shape)}:{flat.dtype}:{flat.device}", flat.numel()), async_op=False)
    finally:
        state.end_bucket(True)  # each call is a step: fresh stochastic-rounding draws, residual carried
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
