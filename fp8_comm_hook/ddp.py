"""The DDP comm hook and its one-line entry point.

No ``from __future__ import annotations`` here: DDP inspects the hook's signature (the second
parameter must be named ``bucket`` and annotated types must be real classes).
"""
import logging
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import autotune, collectives, registry
from .config import FP8CommConfig, env_switch
from .reduce import reduce_bucket
from .state import FP8CommState

__all__ = ["fp8_hook", "register_ddp_hook"]

log = logging.getLogger("fp8_comm_hook")


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
    last = bucket.is_last()
    try:
        return reduce_bucket(state, flat, state.prepare_bucket(bucket.parameters, bucket.gradients, flat), last)
    finally:
        state.end_bucket(last)


_WORKER_ENV = "FP8_COMM_WORKER"
_WORKERS_ENV = "FP8_COMM_WORKERS"
#: ``FP8_COMM_AUTO_NATIVE=0``: ``algorithm="auto"`` registers its hook even where it predicts the plain
#: all-reduce for every bucket (to count the buckets in ``stats()``, or to re-plan later with ``tune``).
_AUTO_NATIVE_ENV = "FP8_COMM_AUTO_NATIVE"


def _worker_count(device: Optional[torch.device] = None) -> int:
    """How many communication workers (``FP8_COMM_WORKERS``): a positive integer. Default 2 for a
    model on CUDA, where a second thread let one bucket's exchange overlap the next one's codec and
    host copies (4 ranks sharing a GPU through gloo, 46M-parameter MLP, three interleaved pairs: fp8
    step 122-128 ms against 139-150 ms with one at 10 Gbit/s, 121-134 against 140-153 unshaped); 1 on
    CPU, where two threads share the rank's cores and re-runs did not confirm a gain."""
    default = "2" if device is not None and device.type == "cuda" else "1"
    text = os.environ.get(_WORKERS_ENV, default).strip()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{_WORKERS_ENV} must be a positive integer (the communication worker threads), "
                         f"got {text!r}")
    return n


def _start_worker(state: FP8CommState, pg, device: Optional[torch.device] = None) -> None:
    """On gloo, give the state a communication worker (:mod:`fp8_comm_hook.worker`) so that the
    backward pass never waits on the wire; ``FP8_COMM_WORKER=0`` keeps the collectives on the hook's
    thread. Every rank decides alike (same backend, same environment is expected; the side group's
    creation is itself a collective)."""
    if state.backend != "gloo":
        return
    if not env_switch(_WORKER_ENV):
        log.info("fp8_comm_hook: %s=0: FP8 buckets run on the hook's thread", _WORKER_ENV)
        return
    if state.config.stochastic_rounding:
        log.info("fp8_comm_hook: stochastic rounding reseeds a shared generator per bucket, so FP8 buckets run on "
                 "the hook's thread (no communication worker)")
        return
    n = _worker_count(device)
    sides = [collectives.new_side_group(pg) for _ in range(n)]
    if sides[0] is None:
        log.info("fp8_comm_hook: the process group does not span every rank; FP8 buckets run on the hook's thread "
                 "(no communication worker)")
        return
    state.use_workers(sides)


def largest_bucket_numel(ddp_model: torch.nn.Module) -> Dict[int, int]:
    """An upper bound on the elements of the gradient buckets ``ddp_model`` (a DDP model) forms in
    its steady state, per gradient element size (bytes): DDP closes a bucket once it holds its byte
    cap (the largest of ``bucket_bytes_cap``, the first bucket's and any per-bucket cap), so a
    bucket is at most the cap plus its last parameter, and never more than all the gradients of
    that element size. Not bounded: the first iteration, where DDP may run every gradient as one
    bucket before it rebuilds them (torch >= 2.13 without ``find_unused_parameters``). Where the
    model has no ``bucket_bytes_cap``, the total."""
    total: Dict[int, int] = {}
    biggest: Dict[int, int] = {}
    for p in ddp_model.parameters():
        if p.requires_grad:
            e = p.element_size()
            total[e] = total.get(e, 0) + p.numel()
            biggest[e] = max(biggest.get(e, 0), p.numel())
    cap = getattr(ddp_model, "bucket_bytes_cap", None)
    if not cap:
        return total
    first = getattr(getattr(ddp_model, "_bucket_config", None), "first_bucket_bytes_cap",
                    getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20))
    cap = max([int(cap), int(first)] + [int(c) for c in (getattr(ddp_model, "bucket_bytes_cap_list", None) or ())])
    return {e: min(total[e], cap // e + biggest[e]) for e in total}


def _plan_auto(state: FP8CommState, ddp_model: torch.nn.Module) -> bool:
    """``algorithm="auto"``'s set-up (a collective): measure the group and the codec, give ``state``
    its plan, and return True where the plain all-reduce is predicted fastest for every bucket the
    model can form (:func:`largest_bucket_numel`), so that no hook should be registered (``state.ddp_native_all_reduce``
    is then True); ``FP8_COMM_AUTO_NATIVE=0`` makes it return False."""
    plan = autotune.tune(state, registry.model_device(ddp_model))  # same figures, same choices on every rank
    largest = largest_bucket_numel(ddp_model)
    sizes = sorted(largest)
    if not (plan.always_plain(sizes, largest) and env_switch(_AUTO_NATIVE_ENV)):
        return False
    # A hook averaging plain buckets divides in a pass of its own after the all-reduce; DDP's own
    # path folds the division into its copy of the gradients into the bucket (one CPU core per
    # rank, 12.6M-parameter MLP, unshaped: a plain-all-reduce hook 4-5 ms a step slower than DDP).
    state.leave_ddp_native_all_reduce()
    log.info("fp8_comm_hook: auto: the plain all-reduce is predicted fastest for every bucket of %s "
             "gradients this model can form on this group: DDP's own all-reduce is left in place (no hook registered; "
             "state.stats() counts nothing; %s=0 registers it anyway)", "/".join(f"{e}-byte" for e in sizes),
             _AUTO_NATIVE_ENV)
    return True


def register_ddp_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, config: Optional[FP8CommConfig] = None,
                      process_group=None) -> FP8CommState:
    """Register :func:`fp8_hook` on ``ddp_model`` and return its :class:`FP8CommState`.

    Binds parameter names (so residuals survive bucket rebuilds and resumes), checks that every rank
    has the same config, and checks that ``nccl_fp8`` can run. On gloo it creates a second process
    group with the same ranks for a communication worker thread (so the backward never waits on the
    wire; ``FP8_COMM_WORKER=0`` turns it off); for ``algorithm="auto"`` it times the group's
    all-reduce and the codec to choose per bucket (:mod:`fp8_comm_hook.autotune`), and where it
    predicts the plain all-reduce for every bucket the model can form registers no hook at all (DDP's own all-reduce
    is faster than any hook's; ``state.ddp_native_all_reduce`` is then True; ``FP8_COMM_AUTO_NATIVE=0``
    registers the hook anyway); on CUDA with NCCL buckets run as captured CUDA graphs
    on a communication stream (``FP8_COMM_CUDA_GRAPHS=0`` turns them off). Raises ``RuntimeError`` if a comm hook
    is already registered, ``ValueError`` for a config that cannot run here.

    Example::

        model = DDP(net)
        state = register_ddp_hook(model, FP8CommConfig(fp8_format="e4m3"))
        ...  # train as usual; state.stats() reports bytes on the wire
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_ddp_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if registry.comm_state(ddp_model) is not None:
        raise RuntimeError("a comm hook is already registered on this DDP model (register_ddp_hook was called "
                           "before); DDP allows one hook per model")
    pg = process_group if process_group is not None else ddp_model.process_group
    state = FP8CommState(config, pg)
    state.bind(ddp_model)
    collectives.check_configs_match(state.config, pg)
    if state.config.algorithm == "nccl_fp8":
        collectives.check_nccl_fp8_supported(pg, registry.model_device(ddp_model))
    _start_worker(state, pg, registry.model_device(ddp_model))
    if state.config.algorithm == "auto" and _plan_auto(state, ddp_model):
        registry.record_state(ddp_model, state)
        return state
    try:
        ddp_model.register_comm_hook(state, fp8_hook)
    except RuntimeError as e:
        if "once" in str(e):
            raise RuntimeError("a comm hook is already registered on this DDP model; DDP allows one hook per "
                               "model, so register_ddp_hook must be the only one") from e
        raise
    registry.record_state(ddp_model, state)
    log.info("fp8_comm_hook: registered on DDP (world %d): %s", state.world_size, state.config)
    return state
