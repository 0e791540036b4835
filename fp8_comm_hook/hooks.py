"""The DDP comm hook and its one-line entry point.

No ``from __future__ import annotations`` here: DDP inspects the hook's signature (the second
parameter must be named ``bucket`` and annotated types must be real classes).
"""
import logging
from typing import Optional

import torch
import torch.distributed as dist

from . import collectives
from .config import FP8CommConfig
from .state import FP8CommState

__all__ = ["fp8_hook", "register_ddp_hook", "all_reduce", "reduce_flat", "check_configs_match"]

log = logging.getLogger("fp8_comm_hook")


def reduce_flat(state: FP8CommState, flat: torch.Tensor, layout_fn, async_op: bool):
    """Average ``flat`` over ``state``'s group with the algorithm the state picks for it; shared by
    the DDP hook and :func:`all_reduce`. ``layout_fn()`` returns the bucket's layout. Returns what
    the collective functions return (``(work, finish)`` when ``async_op``, else ``flat``)."""
    group = state.group
    mode = state.mode_for(flat.numel())
    state.count_bucket(flat, compressed=mode != "none")
    rec = state.stats_recorder
    if mode == "none":
        return collectives.plain_all_reduce(flat, group, stats=rec, async_op=async_op)
    layout = layout_fn()
    codec = state.codec_for(flat.device)
    residual = layout.ensure_residual() if state.config.error_feedback else None
    gen = state.generator_for(flat.device)
    if mode == "nccl_fp8":
        return collectives.nccl_fp8(flat, layout, codec, group, pre_scale=state.config.pre_scale, stats=rec,
                                    residual=residual, generator=gen, async_op=async_op)
    return collectives.two_shot(flat, layout, codec, group, stats=rec, residual=residual, generator=gen,
                                async_op=async_op)


def fp8_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over ranks with FP8 on the wire.

    Register with ``ddp.register_comm_hook(FP8CommState(cfg), fp8_hook)`` or, better,
    :func:`register_ddp_hook` (which also binds parameter names). Returns a Future holding the
    bucket's averaged 1-D tensor, as DDP's hook contract requires. Raises TypeError when called
    per parameter with a ``(grad, param)`` tuple (compiled DDP's python reducer), which it does not
    support.
    """
    if isinstance(bucket, tuple):
        raise TypeError("fp8_hook got a (grad, param) tuple: compiled DDP's python reducer calls comm hooks per "
                        "parameter, which fp8_hook does not support (it compresses whole buckets); compile the "
                        "model without torch._dynamo.config.optimize_ddp='python_reducer', or use eager DDP")
    flat = bucket.buffer()

    def layout_fn():
        return state.layout_for(bucket.parameters(), bucket.gradients(), flat)

    try:
        work, finish = reduce_flat(state, flat, layout_fn, async_op=True)
    finally:
        state.end_bucket(bucket.is_last())
    return work.get_future().then(lambda fut: finish())


def check_configs_match(config: FP8CommConfig, group=None) -> None:
    """Raise ``ValueError`` if any rank of ``group`` holds a different config (mismatched configs
    would otherwise exchange garbage: every rank must derive the same packed sizes)."""
    if dist.get_world_size(group) == 1:
        return
    mine = config.to_dict()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for r, other in enumerate(gathered):
        if other != mine:
            diff = sorted(k for k in mine if mine[k] != other.get(k))
            raise ValueError(f"FP8CommConfig differs between ranks: rank {dist.get_rank(group)} and rank {r} "
                             f"disagree on {diff} ({ {k: mine[k] for k in diff} } vs { {k: other.get(k) for k in diff} })")


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def register_ddp_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, config: Optional[FP8CommConfig] = None,
                      process_group=None) -> FP8CommState:
    """Register :func:`fp8_hook` on ``ddp_model`` and return its :class:`FP8CommState`.

    Binds parameter names (so residuals survive bucket rebuilds and resumes), checks that every rank
    has the same config, and checks that ``nccl_fp8`` can run. Raises ``RuntimeError`` if a comm hook
    is already registered, ``ValueError`` for a config that cannot run here.

    Example::

        model = DDP(net)
        state = register_ddp_hook(model, FP8CommConfig(fp8_format="e4m3"))
        ...  # train as usual; state.stats() reports bytes on the wire
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_ddp_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if getattr(ddp_model, "_fp8_comm_state", None) is not None:
        raise RuntimeError("a comm hook is already registered on this DDP model (register_ddp_hook was called "
                           "before); DDP allows one hook per model")
    pg = process_group if process_group is not None else ddp_model.process_group
    state = FP8CommState(config, pg)
    state.bind(ddp_model)
    check_configs_match(state.config, pg)
    if state.config.algorithm == "nccl_fp8":
        collectives.check_nccl_fp8_supported(pg, _model_device(ddp_model))
    try:
        ddp_model.register_comm_hook(state, fp8_hook)
    except RuntimeError as e:
        if "once" in str(e):
            raise RuntimeError("a comm hook is already registered on this DDP model; DDP allows one hook per "
                               "model, so register_ddp_hook must be the only one") from e
        raise
    ddp_model._fp8_comm_state = state
    log.info("fp8_comm_hook: registered on DDP (world %d): %s", state.world_size, state.config)
    return state


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
    ident = f"all_reduce:{tuple(tensor.shape)}"

    def layout_fn():
        lkey = ((ident,), flat.numel(), flat.dtype, flat.device)
        layout = state._layouts.get(lkey)
        if layout is None:
            from .layout import BucketLayout
            layout = state._layouts[lkey] = BucketLayout(
                [flat.numel()], [0], [ident], state.world_size, state.rank, config.block_size, config.scaling,
                flat.numel(), flat.dtype, flat.device)
        return layout

    try:
        reduce_flat(state, flat, layout_fn, async_op=False)
    finally:
        state.end_bucket(True)  # each call is a step: fresh stochastic-rounding draws, residual carried
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
