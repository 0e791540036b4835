"""``FP8CommState``: what the hooks keep between steps (config, group, layouts, error-feedback
residuals, the step counter and the stats), with checkpointing that holds only tensors and
primitives and pickling without the process group (as torch's PowerSGD state does).

The one call a bucket makes is :meth:`FP8CommState.prepare`: it picks the wire algorithm, counts the
bucket and returns a :class:`BucketPlan` (mode, layout, codec, residual, generator). Layouts are
described by a :class:`~fp8_comm_hook.layout.LayoutSpec` and adopted in one place
(:meth:`FP8CommState.layout`), for DDP buckets, ``all_reduce`` tensors and FSDP flat gradients alike.
"""
import logging
import math
import weakref
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from .codec import get_codec
from .config import FP8CommConfig
from .graphs import BucketGraphs
from .worker import CommWorker
from .layout import BucketLayout, LayoutSpec, PooledLayout
from .stats import CommStats, ring_bytes

__all__ = ["FP8CommState", "BucketPlan"]

log = logging.getLogger("fp8_comm_hook")
STATE_VERSION = 1
_BUCKET_COUNTER = {"none": "uncompressed_buckets", "bf16": "bf16_buckets"}   # every FP8 mode: compressed_buckets


class BucketPlan(NamedTuple):
    """What one bucket needs for its step (:meth:`FP8CommState.prepare`): the wire ``mode``
    ("none", "two_shot", "nccl_fp8", or "bf16" where ``algorithm="auto"`` chose torch's bf16 recipe
    for an all-reduce); for the FP8 modes its ``layout``, ``codec``, error-feedback
    ``residual`` (None without error feedback) and stochastic-rounding ``generator`` (None for RNE)."""

    mode: str
    layout: Optional[BucketLayout] = None
    codec: object = None
    residual: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None
    #: For a plan the state reuses across steps (same bucket, buffer and mode; no stochastic
    #: rounding), a dict the caller may keep what it derives from the plan in (dropped with the
    #: plan when the state's layouts change); None for a plan built for one call.
    memo: Optional[dict] = None


class FP8CommState:
    """Per-rank state of FP8 gradient communication for one model.

    Args:
      config: an :class:`FP8CommConfig` (default: the defaults).
      process_group: the data-parallel group (default: the world group).

    Call :meth:`bind` with the model so per-parameter state (error-feedback residuals) is keyed by
    parameter name; unbound, it is keyed by parameter identity, which does not survive a resume into
    a fresh model (``state_dict()["keyed_by"]`` says which).
    """

    __slots__ = ("config", "process_group", "step", "layouts_built", "loss_scale", "_stats", "_names", "_layouts",
                 "_owner", "_stored_residuals", "_codecs", "_generators", "_bucket_in_step", "_pool", "_step_open",
                 "_world", "_graphs", "_workers", "_side_groups", "_auto", "_ddp_native", "_plans", "_buffer_plans", "_param_plans", "__weakref__")

    def __init__(self, config: Optional[FP8CommConfig] = None, process_group=None):
        if config is not None and not isinstance(config, FP8CommConfig):
            raise TypeError(f"config must be an FP8CommConfig or None, got {type(config).__name__}")
        self.config = config if config is not None else FP8CommConfig()
        self.process_group = process_group
        self.step = 0
        self._stats = CommStats()
        self._names: Dict[int, str] = {}
        self._layouts: Dict[tuple, BucketLayout] = {}
        self._owner: Dict[str, tuple] = {}           # parameter key -> layout key holding it
        self._stored_residuals: Dict[str, torch.Tensor] = {}
        self._codecs: Dict[torch.device, object] = {}
        self._generators: Dict[torch.device, torch.Generator] = {}
        self._bucket_in_step = 0
        self._pool: Dict[tuple, torch.Tensor] = {}   # buffers shared by pooled (FSDP) layouts
        self._step_open = False                      # an FSDP backward's step is open (end_unit)
        self._world = None                           # (world size, rank, backend) of the group, read once
        self._graphs: Optional[BucketGraphs] = None  # captured buckets (CUDA + NCCL), see bucket_graphs()
        self._workers: tuple = ()                    # gloo: threads that run FP8 buckets, see use_workers()
        self._side_groups: tuple = ()                # ... and the process group each issues them on
        self._auto = None                            # algorithm="auto": (numel, element size) -> mode, see set_auto_plan
        # True where register_ddp_hook left DDP's own all-reduce in place (algorithm="auto" found no
        # bucket size to gain): no hook runs, so the counters of stats() stay at zero
        self._ddp_native = False
        self._plans: Dict[tuple, tuple] = {}         # DDP buckets' reusable plans, see prepare_bucket()
        self._buffer_plans: Dict[int, tuple] = {}    # ... the same, found by the bucket buffer's tensor object
        self._param_plans: Dict[int, tuple] = {}     # id of a parameter -> key of the plan of the bucket holding it
        self.layouts_built = 0                      # how many bucket layouts were derived (rebuilds add)
        self.loss_scale: Optional[float] = None     # the loss scale the residuals are in (set_loss_scale)

    # ------------------------------------------------------------------ binding and identity
    def bind(self, model: torch.nn.Module) -> "FP8CommState":
        """Record parameter names of ``model`` (a DDP/FSDP wrapper or a plain module: the wrapped
        module's names are used, so they match an unwrapped model's). Returns self."""
        inner = getattr(model, "module", model)
        self._names = {id(p): n for n, p in inner.named_parameters()}
        self._forget_plans()   # plans hold bucket specs, which hold the names
        return self

    @property
    def keyed_by(self) -> str:
        """"name" after :meth:`bind`, else "identity"."""
        return "name" if self._names else "identity"

    def _key(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        return name if name is not None else f"id:{id(p)}"

    @property
    def group(self):
        """The process group in use (the world group when none was given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _group_facts(self) -> tuple:
        if self._world is None:
            pg = self.process_group
            self._world = (dist.get_world_size(pg), dist.get_rank(pg), dist.get_backend(pg))
        return self._world

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._group_facts()[0]

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._group_facts()[1]

    @property
    def backend(self) -> str:
        """The group's backend ("nccl", "gloo", ...)."""
        return self._group_facts()[2]

    def use_worker(self, side_group) -> None:
        """Run FP8 buckets on a :class:`~fp8_comm_hook.worker.CommWorker` thread, issuing their
        collectives on ``side_group`` (same ranks as the state's group; see
        :func:`fp8_comm_hook.collectives.new_side_group`). ``None`` turns the worker off."""
        self.use_workers([side_group] if side_group is not None else [])

    def use_workers(self, side_groups) -> None:
        """Run FP8 buckets on one :class:`~fp8_comm_hook.worker.CommWorker` thread per group of
        ``side_groups`` (each with the ranks of the state's group, each its own process group), bucket
        i of a step on worker i mod len(side_groups): with two, one bucket's exchange can use the link
        while the other's codec runs. Every rank assigns alike (DDP hands the buckets over in the
        same order everywhere). An empty list turns the workers off."""
        for w in self._workers:
            w.close()
        self._side_groups = tuple(side_groups)
        self._workers = tuple(CommWorker(name=f"fp8-comm-{i}") for i in range(len(self._side_groups)))

    @property
    def worker(self):
        """``(worker, side group)`` that runs the current bucket of the step when FP8 buckets run on
        communication workers (see :meth:`use_workers`), else None."""
        if not self._workers:
            return None
        i = self._bucket_in_step % len(self._workers)
        return self._workers[i], self._side_groups[i]

    def bucket_graphs(self) -> BucketGraphs:
        """The captured CUDA graphs of this state's DDP buckets (see :mod:`fp8_comm_hook.graphs`)."""
        if self._graphs is None:
            self._graphs = BucketGraphs()
        return self._graphs

    # ------------------------------------------------------------------ per-step machinery
    def codec_for(self, device: torch.device):
        """The codec for gradients on ``device`` (built once per device)."""
        device = torch.device(device)
        c = self._codecs.get(device)
        if c is None:
            c = self._codecs[device] = get_codec(self.config, device)
        return c

    def generator_for(self, device: torch.device) -> Optional[torch.Generator]:
        """The stochastic-rounding generator, reseeded from (seed, step, bucket, rank) so that runs
        are reproducible; None when rounding is RNE."""
        if not self.config.stochastic_rounding:
            return None
        device = torch.device(device)
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        mix = (self.config.seed * 1_000_003 + self.step) * 65_537 + self._bucket_in_step
        g.manual_seed((mix * 8191 + self.rank) & 0x7FFF_FFFF_FFFF_FFFF)
        return g

    def bucket_spec(self, params: List[torch.Tensor], grads, flat: torch.Tensor) -> LayoutSpec:
        """The :class:`LayoutSpec` of a DDP bucket holding ``params``, whose gradients are views of
        ``flat`` (keyed by parameter name after :meth:`bind`). ``grads`` is the list of gradients or a
        callable returning it (``bucket.gradients``, called here: :meth:`prepare_bucket` asks only
        for buckets it has not seen)."""
        if callable(grads):
            grads = grads()
        esize, base = flat.element_size(), flat.data_ptr()
        return LayoutSpec(tuple(self._key(p) for p in params), tuple(g.numel() for g in grads),
                          tuple((g.data_ptr() - base) // esize for g in grads))

    def layout(self, spec: LayoutSpec, flat: torch.Tensor) -> BucketLayout:
        """The cached layout of ``spec`` for ``flat`` (its numel, dtype and device), built on first
        use; the one place a layout is adopted. Adopting retires every layout that held one of the
        same keys (DDP rebuilt its buckets, FSDP re-wrapped), carrying their residuals over by key."""
        W = spec.world_size if spec.world_size is not None else self.world_size
        rank = spec.rank if spec.rank is not None else self.rank
        lkey = (spec.names, flat.numel(), flat.dtype, flat.device, W, rank, spec.pooled)
        layout = self._layouts.get(lkey)
        if layout is not None:
            return layout
        cls = PooledLayout if spec.pooled else BucketLayout
        layout = cls(spec.numels, spec.src_offsets, spec.names, W, rank, self.config.block_size, self.config.scaling,
                     flat.numel(), flat.dtype, flat.device)
        for old in {self._owner[k] for k in spec.names if k in self._owner and self._owner[k] != lkey}:
            self._retire(old)
        for k in spec.names:
            self._owner[k] = lkey
        self._layouts[lkey] = layout
        self.layouts_built += 1
        if self.config.error_feedback:
            self._restore_residuals(layout)
        return layout

    def live_layouts(self) -> List[BucketLayout]:
        """The layouts in use (one per bucket, ``all_reduce`` shape or FSDP flat gradient)."""
        return list(self._layouts.values())

    def prepare(self, flat: torch.Tensor, spec: LayoutSpec, collective: str = "all_reduce") -> BucketPlan:
        """Everything one bucket needs, in one call: the wire mode for ``flat`` at this step, the
        bucket counted in the stats (against a ring ``collective``, "all_reduce" or
        "reduce_scatter", in ``flat``'s dtype), and for an FP8 mode the layout of ``spec`` (a pooled
        one bound to the buffers this algorithm uses), the codec, the residual and the generator.
        A new plan each call (``memo`` None); DDP buckets, whose buffers live across steps, get
        reusable ones from :meth:`prepare_bucket`."""
        return self._build_plan(flat, spec, collective, self.mode_for(flat.numel(), flat.element_size()), None)

    def prepare_bucket(self, params, grads, flat: torch.Tensor) -> BucketPlan:
        """:meth:`prepare` for a DDP bucket holding ``params`` (a list, or a callable returning it such
        as ``bucket.parameters``; ``grads`` as in :meth:`bucket_spec`). The plan of a bucket seen
        before (same parameters, buffer, dtype and mode) is the same object, with a ``memo`` dict for
        the caller, until a layout is adopted or retired (stochastic rounding, whose generator is
        reseeded per bucket, gets a new plan each call): the hook's host time per bucket is what a
        step pays.

        A bucket seen before is found by its buffer's tensor object (DDP hands the hook the same
        Python object for a live bucket every step), checked through a weak reference, without
        asking for its parameters: a buffer's parameters are fixed while it lives, and a rebuilt
        bucket is a new buffer, so a new object (a dead one's reused ``id`` fails the check)."""
        numel = flat.numel()
        mode = self.mode_for(numel, flat.element_size())
        fast = self._buffer_plans.get(id(flat))
        if fast is not None and fast[1] == mode and fast[0]() is flat:
            self._stats.add_bucket(fast[3], fast[4])
            return fast[2]
        if callable(params):
            params = params()
        key = (tuple(map(id, params)), flat.data_ptr(), numel, flat.dtype, flat.get_device(), mode)
        hit = self._plans.get(key)
        if hit is not None:
            self._stats.add_bucket(hit[1], hit[2])
        else:
            plan = self._build_plan(flat, self.bucket_spec(params, grads, flat), "all_reduce", mode, key)
            hit = self._plans.get(key)
            if hit is None or hit[0] is not plan:   # not reusable
                return plan
            self._drop_superseded(key)
        self._buffer_plans[id(flat)] = (weakref.ref(flat), mode) + hit
        return hit[0]

    def _forget_plans(self) -> None:
        """Drop every reusable DDP bucket plan (their layouts or names changed)."""
        self._plans.clear()
        self._buffer_plans.clear()
        self._param_plans.clear()

    def _drop_superseded(self, key: tuple) -> None:
        """A new reusable plan ``key`` holds these parameters: drop the plans of every other bucket
        that held one of them. A parameter lives in one DDP bucket at a time, so those buckets are
        gone (DDP rebuilt its buckets after the first step) or their mode moved on (warm-up over),
        and their plans, whose CUDA-graph runners keep the old bucket buffer alive, must not pin
        that memory (a model's whole gradient size) for the rest of training."""
        ids = key[0]
        stale = {self._param_plans.get(i) for i in ids}
        stale.discard(None)
        stale.discard(key)
        for k in stale:
            old = self._plans.pop(k, None)
            if old is not None:
                for bid in [b for b, e in self._buffer_plans.items() if e[2] is old[0]]:
                    del self._buffer_plans[bid]
        for i in ids:
            self._param_plans[i] = key

    def _build_plan(self, flat: torch.Tensor, spec: LayoutSpec, collective: str, mode: str,
                    key: Optional[tuple]) -> BucketPlan:
        """Count the bucket and build its plan; where ``key`` is given and the plan can be reused
        (not pooled, no stochastic rounding), cache it under ``key``."""
        numel, esize = flat.numel(), flat.element_size()
        if mode == "bf16" and (collective != "all_reduce" or esize <= 2):
            mode = "none"   # the bf16 recipe is an all-reduce of a wider dtype
        baseline = ring_bytes(collective, numel * esize, self.world_size if spec.world_size is None else spec.world_size)
        counter = _BUCKET_COUNTER.get(mode, "compressed_buckets")
        self._stats.add_bucket(counter, baseline)
        reusable = key is not None and not spec.pooled and not self.config.stochastic_rounding
        if mode == "none" or mode == "bf16":
            plan = BucketPlan(mode, memo={} if reusable else None)
        else:
            layout = self.layout(spec, flat)
            if isinstance(layout, PooledLayout):
                layout.bind(self._pool, ("rs_" if collective == "reduce_scatter" else "ar_") + mode)
            residual = layout.ensure_residual() if self.config.error_feedback else None
            plan = BucketPlan(mode, layout, self.codec_for(flat.device), residual, self.generator_for(flat.device),
                              {} if reusable else None)
        if reusable:
            if len(self._plans) >= 4096:  # buckets rebuilt many times: forget the old buffers
                self._forget_plans()
            self._plans[key] = (plan, counter, baseline)
        return plan

    def _retire(self, lkey: tuple) -> None:
        old = self._layouts.pop(lkey, None)
        if old is None:
            return
        self._forget_plans()   # plans hold layouts: none may outlive its layout
        if old.residual is not None:
            for i, name in enumerate(old.names):
                self._stored_residuals[name] = old.segment(old.residual, i).clone()
        for k in old.names:
            if self._owner.get(k) == lkey:
                del self._owner[k]

    def _restore_residuals(self, layout: BucketLayout) -> None:
        hits = [(i, n) for i, n in enumerate(layout.names) if n in self._stored_residuals]
        if not hits:
            return
        res = layout.ensure_residual()
        for i, name in hits:
            r = self._stored_residuals.pop(name)
            if r.numel() == layout.numels[i]:
                layout.segment(res, i).copy_(r.to(res.device, res.dtype))
            else:
                log.warning("fp8_comm_hook: dropping residual of %s: %d elements saved, %d now", name,
                            r.numel(), layout.numels[i])

    def mode_for(self, numel: int, element_size: int = 4) -> str:
        """The wire algorithm for a bucket of ``numel`` elements of ``element_size`` bytes at the
        current step. For ``algorithm="auto"`` the plan set by :meth:`set_auto_plan` decides (without
        one, e.g. under FSDP: ``two_shot``, logged once)."""
        cfg = self.config
        if cfg.algorithm == "none" or self.step < cfg.warmup_steps or numel < cfg.min_compress_numel:
            return "none"
        if cfg.algorithm != "auto":
            return cfg.algorithm
        if self._auto is None:
            log.warning("fp8_comm_hook: algorithm='auto' without a measured plan (register_ddp_hook measures one; "
                        "else call fp8_comm_hook.autotune.tune(state) on every rank): using two_shot")
            self._auto = lambda n, e: "two_shot"
        return self._auto(numel, element_size)

    def set_auto_plan(self, plan) -> None:
        """Give ``algorithm="auto"`` its per-bucket choice: ``plan(numel, element_size)`` returns
        "two_shot", "bf16" (all-reduces of buckets wider than 2 bytes; else taken as "none") or
        "none" and must return the same on every rank (see
        :func:`fp8_comm_hook.autotune.tune`, which builds one from measured figures)."""
        self._auto = plan

    @property
    def auto_plan(self):
        """The plan ``algorithm="auto"`` decides with (an :class:`~fp8_comm_hook.autotune.AutoPlan`
        after registration: ``state.auto_plan.report()`` gives its figures and choices), or None."""
        return self._auto

    def end_bucket(self, is_last: bool) -> None:
        """Advance the bucket counter; after the step's last bucket, the step counter."""
        self._bucket_in_step += 1
        if is_last:
            self._bucket_in_step = 0
            self.step += 1
            self._stats.add("steps", 1)

    def end_unit(self) -> None:
        """Account one FSDP flat gradient: the step ends when the backward pass that reduced it ends
        (a callback queued on the autograd engine); outside a backward every call is its own step."""
        if not self._step_open:
            def close_step():
                self._step_open = False
                self.end_bucket(True)

            try:
                torch.autograd.Variable._execution_engine.queue_callback(close_step)
                self._step_open = True
            except RuntimeError:  # not inside a backward pass
                self.end_bucket(True)
                return
        self.end_bucket(False)

    @property
    def bucket_in_step(self) -> int:
        """How many buckets (or FSDP flat gradients) this step has reduced so far."""
        return self._bucket_in_step

    @property
    def ddp_native_all_reduce(self) -> bool:
        """True where ``register_ddp_hook`` left DDP's own all-reduce in place (``algorithm="auto"``
        predicted the plain all-reduce for every bucket the model can form): no hook runs for this state."""
        return self._ddp_native

    def leave_ddp_native_all_reduce(self) -> None:
        """Record that no hook was registered for this state and DDP's own all-reduce runs (called by
        ``register_ddp_hook``; the counters of :meth:`stats` then stay at zero). The communication
        workers are closed: no bucket will reach them."""
        self._ddp_native = True
        self.use_workers([])

    @property
    def stats_recorder(self) -> CommStats:
        """The counters the wire algorithms add to."""
        return self._stats

    def stats(self) -> Dict[str, int]:
        """Counters since registration: steps, bytes_sent, bytes_baseline, compressed_buckets (FP8),
        uncompressed_buckets (plain), bf16_buckets (``algorithm="auto"`` chose the bf16 recipe),
        nonfinite_buckets, saturated_values (reading device counters). All zero where
        ``ddp_native_all_reduce`` is True (``algorithm="auto"`` left DDP's own all-reduce in place)."""
        return self._stats.as_dict()

    # ------------------------------------------------------------------ loss scaling
    def rescale_residuals(self, factor: float) -> None:
        """Multiply every error-feedback residual of this rank (live layouts and residuals waiting
        for a layout) by ``factor``, a finite positive number. Raises ``ValueError`` otherwise."""
        factor = float(factor)
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"rescale_residuals: factor must be a finite number > 0, got {factor!r}")
        if factor == 1.0:
            return
        for layout in self._layouts.values():
            if layout.residual is not None:
                layout.residual.mul_(factor)
        for r in self._stored_residuals.values():
            r.mul_(factor)

    def set_loss_scale(self, scale: float) -> float:
        """Tell the state the loss scale of the next backward's gradients (``GradScaler.get_scale()``);
        call it before every backward, or at least whenever the scale may have changed.

        Error-feedback residuals are measured in the gradients' units, which a dynamic loss scale
        multiplies: when ``scale`` differs from the last one given, every residual is multiplied by
        ``scale / last`` so that it is added to the next gradient in that gradient's units (without
        it, a halving after an overflow adds the carried error twice, a growth adds half of it). The
        first call only records the scale. Returns the factor applied (1.0 when nothing changed).
        Raises ``ValueError`` for a scale that is not a finite number > 0.

        Example::

            state = register_ddp_hook(model, FP8CommConfig(error_feedback=True))
            for x, y in loader:
                state.set_loss_scale(scaler.get_scale())
                scaler.scale(loss_fn(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
        """
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"set_loss_scale: scale must be a finite number > 0, got {scale!r}")
        last, self.loss_scale = self.loss_scale, scale
        if last is None or last == scale:
            return 1.0
        factor = scale / last
        self.rescale_residuals(factor)
        return factor

    def follow_grad_scaler(self, scaler) -> float:
        """:meth:`set_loss_scale` with ``scaler.get_scale()`` for an enabled ``torch.amp.GradScaler``
        (what the trainer integrations call before each backward); nothing for None or a disabled
        scaler. Returns the factor applied to the residuals."""
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return self.set_loss_scale(scaler.get_scale())

    # ------------------------------------------------------------------ checkpointing
    def residuals(self) -> Dict[str, torch.Tensor]:
        """This rank's error-feedback residual per parameter key (fp32 copies, unpadded)."""
        out = dict((k, v.clone()) for k, v in self._stored_residuals.items())
        for layout in self._layouts.values():
            if layout.residual is not None:
                for i, name in enumerate(layout.names):
                    out[name] = layout.segment(layout.residual, i).detach().cpu().clone()
        return {k: v.cpu() for k, v in out.items()}

    def state_dict(self) -> dict:
        """Tensors and primitives only (``torch.load(weights_only=True)`` works): version, step,
        world size, config, ``keyed_by``, stats, this rank's residuals and the loss scale they are in
        (None unless :meth:`set_loss_scale` was called). Per rank: save one file per rank (residuals
        differ by rank)."""
        try:
            world = self.world_size
        except Exception:
            world = None
        return {"version": STATE_VERSION, "step": self.step, "world_size": world,
                "config": self.config.to_dict(), "keyed_by": self.keyed_by, "stats": self.stats(),
                "residuals": self.residuals(), "loss_scale": self.loss_scale}

    def load_state_dict(self, sd: dict) -> None:
        """Restore from :meth:`state_dict` output (after binding to a fresh model). Residuals saved
        at another world size, or keyed by identity, are dropped with a warning; non-finite residual
        values (saved by a version that let a non-finite step into them) are set to 0, with a
        warning naming the parameters."""
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"state_dict version {sd.get('version')!r} is not {STATE_VERSION}")
        self.step = int(sd["step"])
        self._stats.load(sd.get("stats", {}))
        residuals = dict(sd.get("residuals", {}))
        if residuals and sd.get("keyed_by") != "name":
            log.warning("fp8_comm_hook: dropping %d residuals keyed by parameter identity (bind the state "
                        "to the model before saving to keep them)", len(residuals))
            residuals = {}
        try:
            world = self.world_size
        except Exception:
            world = sd.get("world_size")
        if residuals and sd.get("world_size") != world:
            log.warning("fp8_comm_hook: dropping residuals saved at world size %s (now %s)", sd.get("world_size"), world)
            residuals = {}
        for layout in list(self._layouts):
            self._retire(layout)
        self._stored_residuals = _finite_residuals(residuals)
        scale = sd.get("loss_scale")
        self.loss_scale = float(scale) if scale is not None else None

    # ------------------------------------------------------------------ pickling (no process group)
    def __getstate__(self):
        # Parameter names are keyed by object identity, which means nothing in another process:
        # call bind() again after unpickling. Residuals (keyed by name) travel.
        return {"config": self.config, "step": self.step, "stats": self._stats.as_dict(),
                "residuals": self.residuals(), "loss_scale": self.loss_scale}

    def __setstate__(self, s):
        self.__init__(s["config"], None)
        self.step = s["step"]
        self._stats.load(s["stats"])
        self._stored_residuals = _finite_residuals(s["residuals"])
        self.loss_scale = s.get("loss_scale")


def _finite_residuals(residuals: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Copies of ``residuals`` with non-finite values set to 0, with one warning naming the
    parameters that had them (a residual must never carry an Inf or NaN into a step)."""
    out, dirty = {}, []
    for k, v in residuals.items():
        v = v.clone()
        bad = ~torch.isfinite(v)
        n = int(bad.sum())
        if n:
            v.masked_fill_(bad, 0.0)
            dirty.append(f"{k} ({n} non-finite of {v.numel()})")
        out[k] = v
    if dirty:
        log.warning("fp8_comm_hook: error-feedback residuals with non-finite values set to 0 on load: %s",
                    ", ".join(dirty))
    return out
