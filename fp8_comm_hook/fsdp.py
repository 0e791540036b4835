"""FP8 gradient reduce-scatter for FSDP: one call, :func:`register_fsdp_hook`, for both generations.

**FSDP1** (``torch.distributed.fsdp.FullyShardedDataParallel``): pass the *root* FSDP module. A comm
hook (:func:`fsdp_hook`) is registered through ``model.register_comm_hook``; FSDP then skips its own
gradient pre/post-divide factors, so the hook produces the mean over ranks itself.

- ``FULL_SHARD`` / ``SHARD_GRAD_OP``: an FP8 reduce-scatter (the first half of ``two_shot``): every
  rank quantizes each destination's shard with its own scales, one ``all_to_all_single`` of packed
  FP8 bytes + fp32 scales, the owner dequantizes and sums the W contributions in fp32 and divides
  by W, and writes its shard into FSDP's output in the reduce dtype. The wire carries one FP8 byte
  per element (plus 4 bytes of scale per ``block_size`` elements) instead of 2 or 4, and the shard
  is quantized once (not twice as in an FP8 all-reduce), so the error is that of one quantization.
- ``NO_SHARD``: the full ``two_shot`` all-reduce in place, as the DDP hook does.
- ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: FSDP1 has no comm hook for them; ``ValueError``.

**FSDP2** (``torch.distributed.fsdp.fully_shard``, torch >= 2.9): a :class:`FP8ReduceScatter`
(a ``ReduceScatter`` comm) is installed with ``set_custom_reduce_scatter`` on every ``FSDPModule``
under ``model`` (one comm per module, so error feedback is kept per module), and
``set_force_sum_reduction_for_comms(True)`` makes FSDP hand it ``ReduceOp.SUM``. The comm returns
the SUM over the shard group (FP8 on the wire, fp32 accumulation) and FSDP divides once by its
gradient divide factor (the data-parallel size by default, ``set_gradient_divide_factor`` if the
user set one), after its replicate all-reduce under HSDP (a 2-D mesh): the mean is taken exactly
once in 1-D and 2-D meshes. Only the reduce-scatter is compressed; HSDP's all-reduce over the
replicate dimension stays FSDP's own. FSDP2 does not call the comm at shard-group size 1.

This module only adapts FSDP to the shared seam: the reduce-scatter and all-reduce themselves are
:func:`fp8_comm_hook.reduce.reduce_scatter_flat` / :func:`~fp8_comm_hook.reduce.reduce_flat`, the wire
algorithms those run live in :mod:`fp8_comm_hook.collectives`, and step accounting is
:meth:`FP8CommState.end_unit <fp8_comm_hook.state.FP8CommState.end_unit>`.

Geometry. FSDP's flat gradient is a multiple of the shard-group size W; rank r owns chunk r
(``chunk = numel / W``), and those boundaries are kept. Each chunk is padded on its own to a
multiple of ``block_size`` (a :class:`~fp8_comm_hook.layout.PooledLayout` of
:meth:`LayoutSpec.shards <fp8_comm_hook.layout.LayoutSpec.shards>`, whose W segments are the W chunks), so scaling blocks start at the chunk boundary. Unlike the DDP hook, parameters inside a
chunk are *not* block-aligned: a block may straddle two parameters (FSDP1 flattens several
parameters into one flat parameter; FSDP2 concatenates each parameter's dim-0 shard), so a small
parameter next to a large one shares its scale. ``scaling="tensor"`` and ``"bucket"`` both give one
scale per chunk here (a chunk is the only segment the layout sees).

Numerics and stats follow the DDP hook: the config's ``fp8_format``, ``scaling``, ``block_size``,
``min_compress_numel`` (of the whole flat gradient), ``warmup_steps``, ``error_feedback`` and
``stochastic_rounding`` apply; ``state.stats()`` counts ``bytes_sent`` (what this rank hands to
collectives for other ranks) against ``bytes_baseline`` (a ring reduce-scatter in the reduce dtype
for sharded reduction, a ring all-reduce for NO_SHARD); one flat gradient counts as one bucket and
one backward as one step. An Inf or NaN anywhere in a block on any rank makes that whole block
non-finite in its owner's output shard (never saturated to +-fmax); ``nonfinite_buckets`` counts on
the owner. ``algorithm="nccl_fp8"`` uses NCCL's FP8 SUM reduce-scatter with shared scales (one MAX
all-reduce of the amax vector first) and needs NCCL on an sm90+ GPU; ``algorithm="none"`` leaves
FSDP's own reduce-scatter in place (nothing is registered).

Memory. The FP8 staging, scratch and packed buffers (about 11 bytes per element of a unit's
unsharded flat gradient) are one pool per state, sized for the largest FSDP unit and shared by all
units (see :class:`~fp8_comm_hook.layout.PooledLayout`), not kept per unit. Error feedback adds a persistent fp32 residual
of each unit's *unsharded* flat gradient (4 bytes per element of the whole model, per rank): it is
this rank's own quantization error for every destination, so it cannot be sharded.

Root. FSDP1 only knows which module is the root after the first forward (or after
``register_comm_hook``, which makes the module it is called on the root). Registered after a forward,
a nested FSDP module raises ``ValueError``; registered before, pass the outermost module (a nested one
would be made a root by FSDP itself, and FSDP then fails at the real root's first forward).

Error feedback keeps this rank's quantization error per flat gradient: keyed
``"fsdp1:<module name>[r]"`` / ``"fsdp2:<module name>[r]"`` for destination chunk r (module names as
in the unwrapped model, ``<root>`` for the root). ``state.state_dict()`` saves them per rank; they
are restored on resume only into the same wrapping (same FSDP units, same flat-gradient sizes) at
the same world size; otherwise they are dropped with a warning and error feedback restarts from zero.

Example (FSDP1)::

    model = FSDP(net, sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)
    state = register_fsdp_hook(model, FP8CommConfig(fp8_format="e4m3"))

Example (FSDP2)::

    mesh = init_device_mesh("cuda", (world_size,))
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    state = register_fsdp_hook(net, FP8CommConfig())
    ...  # train as usual; state.stats() reports bytes on the wire
"""
import logging
from typing import Optional

import torch
import torch.distributed as dist

from . import collectives, registry
from .config import FP8CommConfig
from .layout import LayoutSpec
from .reduce import reduce_flat, reduce_scatter_flat
from .state import FP8CommState

__all__ = ["register_fsdp_hook", "fsdp_hook", "FP8ReduceScatter", "FSDP2_MIN_TORCH"]

log = logging.getLogger("fp8_comm_hook")

#: The first torch release whose ``FSDPModule`` has ``set_custom_reduce_scatter``.
FSDP2_MIN_TORCH = "2.9"

try:  # torch >= 2.9
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # older torch: the class still exists, registration refuses to install it
    _ReduceScatterBase = object

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # torch without FSDP2
    _FSDPModule = None

_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


# ---------------------------------------------------------------------------------- FSDP1
class _FSDPUnitState:
    """What an FSDP1 unit hands :func:`fsdp_hook`: the shared state and the unit's residual key."""

    def __init__(self, state: FP8CommState, key: str):
        self.state, self.key = state, key


def fsdp_hook(state, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """FSDP1 communication hook: with ``output`` (sharded strategies) write the mean of ``grad``'s
    chunk ``rank`` over ranks into ``output``; without (NO_SHARD) average ``grad`` in place.

    ``state`` is an :class:`FP8CommState` (flat gradients are then keyed by their order within the
    backward pass) or the per-unit state :func:`register_fsdp_hook` installs (keyed by module name).
    Register through :func:`register_fsdp_hook`, which also checks strategies and configs.
    """
    if isinstance(state, _FSDPUnitState):
        st, key = state.state, state.key
    else:
        st, key = state, f"fsdp1:unit{state.bucket_in_step}"
    try:
        if output is None:
            flat = grad.view(-1)
            reduce_flat(st, flat, LayoutSpec.single(key, flat.numel(), pooled=True), async_op=False)
        else:
            reduce_scatter_flat(st, key, grad, output, st.group, average=True)
    finally:
        st.end_unit()


def _clean_name(name: str) -> str:
    """A module name as in the unwrapped model ("<root>" for the root)."""
    parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")]
    return ".".join(parts) or "<root>"


def _register_fsdp1(model, state: FP8CommState) -> FP8CommState:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if getattr(model, "_is_root", None) is False:
        raise ValueError("register_fsdp_hook needs the root FSDP module (the outermost FullyShardedDataParallel); "
                         "this one is nested inside another FSDP module. FSDP1 comm hooks are registered on the "
                         "root and apply to every unit under it.")
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    for name, m in units:
        strategy = getattr(m, "sharding_strategy", None)
        if strategy is not None and strategy.name in _HYBRID:
            raise ValueError(f"FSDP1 sharding strategy {strategy.name} (module {_clean_name(name)!r}) is not supported: "
                             "FSDP1 has no comm hook for hybrid strategies. Use FULL_SHARD, SHARD_GRAD_OP or "
                             "NO_SHARD, or FSDP2 (fully_shard) with a 2-D mesh.")
    if state.config.algorithm == "none":
        log.info("fp8_comm_hook: algorithm='none': FSDP1 keeps its own reduce-scatter (no hook registered)")
        return state
    try:
        model.register_comm_hook(state, fsdp_hook)
    except AssertionError as e:
        if "already registered" in str(e):
            raise RuntimeError("a comm hook is already registered on this FSDP model; FSDP1 allows one hook "
                               "per model") from e
        if "root" in str(e):
            raise ValueError(f"register_fsdp_hook needs the root FSDP module: {e}") from e
        raise
    # Per-unit keys, so error feedback is kept per flat gradient. FSDP1's register_comm_hook hands
    # every unit the same state object and has no per-unit API, so each unit's hook state (FSDP1's
    # own attribute, which it passes to the hook) is replaced by a wrapper naming the unit.
    for name, m in units:
        if getattr(m, "_comm_hook_state", None) is state:
            m._comm_hook_state = _FSDPUnitState(state, f"fsdp1:{_clean_name(name)}")
    registry.record_state(model, state)
    log.info("fp8_comm_hook: registered on FSDP1 (%d units, world %d): %s", len(units), state.world_size,
             state.config)
    return state


# ---------------------------------------------------------------------------------- FSDP2
class FP8ReduceScatter(_ReduceScatterBase):
    """FSDP2 ``ReduceScatter`` comm sending gradients in FP8 (install with :func:`register_fsdp_hook`).

    ``__call__(output_tensor, input_tensor, group, op, async_op=False)`` reduces ``input_tensor``
    (W equal chunks, rank r's shard in chunk r) over ``group`` into ``output_tensor``: the SUM for
    ``ReduceOp.SUM``, the mean for ``ReduceOp.AVG``. It runs synchronously (gloo deadlocks on
    collectives issued from callbacks); with ``async_op=True`` it returns an already-completed work.
    """

    def __init__(self, state: FP8CommState, key: str):
        self.state, self.key = state, key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer (FSDP keeps the reduce-scatter input alive until the next one)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                 async_op: bool = False):
        if op == dist.ReduceOp.SUM:
            average = False
        elif op == dist.ReduceOp.AVG:
            average = True
        else:
            raise ValueError(f"FP8ReduceScatter supports ReduceOp.SUM and AVG, got {op!r}: call "
                             "set_force_sum_reduction_for_comms(True) on the FSDP module (register_fsdp_hook does)")
        try:
            reduce_scatter_flat(self.state, self.key, input_tensor, output_tensor.view(-1), group, average)
        finally:
            self.state.end_unit()
        if not async_op:
            return None
        fut = torch.futures.Future()
        fut.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(fut)


def _register_fsdp2(model, state: FP8CommState, modules) -> FP8CommState:
    if not hasattr(_FSDPModule, "set_custom_reduce_scatter") or _ReduceScatterBase is object:
        raise RuntimeError(f"FSDP2 (fully_shard) needs torch >= {FSDP2_MIN_TORCH} for FP8 gradient communication "
                           f"(FSDPModule.set_custom_reduce_scatter); this is torch {torch.__version__}. Upgrade torch "
                           "or use FSDP1 (FullyShardedDataParallel) with register_fsdp_hook.")
    if isinstance(model, _FSDPModule):
        fsdp_state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
        if getattr(fsdp_state, "_is_root", None) is False:
            raise ValueError("register_fsdp_hook needs the root module of the FSDP2 model (the outermost module "
                             "fully_shard was applied to); this FSDPModule is nested inside another one")
    if state.config.algorithm == "none":
        log.info("fp8_comm_hook: algorithm='none': FSDP2 keeps its own reduce-scatter (nothing installed)")
        return state
    for name, m in modules:
        comm = FP8ReduceScatter(state, f"fsdp2:{name or '<root>'}")
        m.set_custom_reduce_scatter(comm)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
        registry.record_state(m, state)
    log.info("fp8_comm_hook: installed on FSDP2 (%d modules): %s", len(modules), state.config)
    return state


# ---------------------------------------------------------------------------------- entry point
def register_fsdp_hook(model: torch.nn.Module, config: Optional[FP8CommConfig] = None,
                       process_group=None) -> FP8CommState:
    """Send ``model``'s FSDP gradient reduction over the wire in FP8; returns its :class:`FP8CommState`.

    ``model`` is the root ``FullyShardedDataParallel`` module (FSDP1) or a module tree containing
    ``fully_shard`` modules (FSDP2; every ``FSDPModule`` under it gets an :class:`FP8ReduceScatter`).
    ``process_group`` defaults to FSDP1's process group, or the world group for FSDP2 (where it is
    only used to check that every rank has the same config: the comm reduces over the group FSDP
    passes it). See the module docstring for strategies, numerics and stats.

    Raises ``RuntimeError`` when FP8 communication is already registered on the model, ``ValueError``
    for a non-root FSDP module, an FSDP1 hybrid strategy, mismatched configs across ranks or
    ``nccl_fp8`` off NCCL/sm90+, ``TypeError`` for a model without FSDP.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(config, dict):
        config = FP8CommConfig.from_dict(config)
    fsdp1 = isinstance(model, FSDP)
    fsdp2 = [] if _FSDPModule is None else [(n, m) for n, m in model.named_modules() if isinstance(m, _FSDPModule)]
    if not fsdp1 and not fsdp2:
        if any(isinstance(m, FSDP) for m in model.modules()):
            raise ValueError("register_fsdp_hook needs the root FullyShardedDataParallel module itself, not a "
                             f"{type(model).__name__} containing FSDP modules")
        raise TypeError(f"register_fsdp_hook needs an FSDP model (FullyShardedDataParallel or fully_shard), "
                        f"got {type(model).__name__}")
    if registry.comm_state(model) is not None or any(registry.comm_state(m) is not None for _, m in fsdp2):
        raise RuntimeError("FP8 gradient communication is already registered on this FSDP model "
                           "(register_fsdp_hook was called before); register it once")
    pg = process_group if process_group is not None else (model.process_group if fsdp1 else None)
    state = FP8CommState(config, pg)
    state.bind(model)
    collectives.check_configs_match(state.config, pg)
    if state.config.algorithm == "nccl_fp8":
        collectives.check_nccl_fp8_supported(state.group, registry.model_device(model))
    if fsdp1:
        return _register_fsdp1(model, state)
    return _register_fsdp2(model, state, fsdp2)
