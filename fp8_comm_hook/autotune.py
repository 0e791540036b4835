"""``algorithm="auto"``: per bucket, FP8 ``two_shot``, torch's bf16 recipe (for buckets wider than bf16,
where the group can sum bf16) or the plain all-reduce in the bucket's dtype, whichever a measured cost
model predicts fastest.

The model (pure functions of six figures, :class:`Figures`):

- a plain all-reduce of ``B`` bytes takes ``latency_s + s_per_byte * B`` (both fitted from timed
  fp32 all-reduces of two sizes on the group, so ``s_per_byte`` already holds the ring's
  2(W-1)/W factor and the sum);
- FP8 ``two_shot`` of ``n`` elements is two collectives moving, together, as many bytes per rank as
  a ring all-reduce of the packed FP8 bucket (payload plus scales, :func:`fp8_bytes_per_elem`) plus
  the codec's encode, owner reduce and decode on this device, its cost per element counted
  ``CODEC_WEIGHT`` times:
  ``2 * latency_s + s_per_byte * n * fp8_bytes_per_elem + codec_fixed_s + w * codec_s_per_elem * n``;
- the bf16 recipe (cast to bf16, divide, all-reduce, cast back) of ``n`` elements:
  ``latency_s + bf16_s_per_elem * n + cast_s_per_elem * n``, where ``bf16_s_per_elem`` comes from
  timed bf16 all-reduces (a backend may sum bf16 slower than fp32: gloo on the host does).

The codec's cost per element counts twice (``w`` = :data:`CODEC_WEIGHT`): in a training step it runs
beside the backward pass on the same cores or SMs, so it delays the backward as well as the
collective it precedes, while the wire time overlaps the backward. Its fixed cost (mostly launches
and host work on the communication thread) and the bf16 casts count once (measured: see
:data:`CODEC_WEIGHT`).

The fastest prediction wins; a tie goes to the plain all-reduce, then bf16 (:func:`choose`). Every rank measures its own
figures, then one MAX all-reduce gives every rank the same (slowest rank's) figures, so every rank
makes the same choice for every bucket (ranks that chose differently would hang). ``warmup_steps``
and ``min_compress_numel`` still come first (:meth:`fp8_comm_hook.state.FP8CommState.mode_for`).

:func:`tune` measures and hands the resulting :class:`AutoPlan` to the state; ``register_ddp_hook``
calls it for ``algorithm="auto"``, and a caller may call it again on every rank at the same point
(e.g. after the network changed). ``state.auto_plan.report()`` returns the figures and the choice
per bucket size; the figures and each bucket size's choice are logged once (logger ``fp8_comm_hook``).
"""
import dataclasses
import logging
import time
from typing import Dict, Optional, Sequence, Tuple

import torch

from . import collectives
from .layout import BucketLayout

__all__ = ["CODEC_WEIGHT", "Figures", "AutoPlan", "fit_line", "combine", "fp8_bytes_per_elem", "predict_plain_s",
           "predict_two_shot_s", "predict_cast_s", "choose", "break_even_numel", "measure", "tune"]

log = logging.getLogger("fp8_comm_hook")

#: Sizes (fp32 elements) of the timed all-reduces and of the timed codec runs.
ALL_REDUCE_SIZES = (4096, 1 << 20)
#: The larger timed all-reduce grows (x4, up to ``MAX_ALL_REDUCE`` elements: 64 MB of fp32) until it
#: takes ``SUSTAINED_S`` on the slowest rank. A shorter one rides on the link's burst allowance and
#: the socket buffers and looks cheaper per byte than a 25 MB bucket pays: over 4 nodes on 10 Gbit/s
#: links (CUDA ranks through gloo) 4 MB all-reduces gave 12.4 Gbit/s of bus bandwidth, 16 MB 9.7 and
#: 64 MB 8.8 (the sustained rate); over an unshaped veth between two CPU ranks 4 MB took 2.1 to 5.3 ms
#: from run to run, half the cost per byte of 25 MB buckets, and the model then sent 12.6M-element
#: fp32 buckets plain where the bf16 recipe was faster.
SUSTAINED_S = 0.05
MAX_ALL_REDUCE = 1 << 24
#: The codec and the bf16 casts are timed at 64K and 4M elements: the larger (16 MB of fp32) must
#: spill the caches as a 25 MB bucket does. On one CPU core the torch codec's line through 64K and
#: 1M elements (4.8 ns/element) predicted 61 ms for a 12.6M-element bucket that took 80 ms; through
#: 64K and 4M (6.0 ns/element) 77 ms.
CODEC_SIZES = (1 << 16, 1 << 22)
REPEATS = 5
#: How many times the codec's cost per element counts in a prediction. The wire overlaps the
#: backward pass; the codec runs beside it on the same device and delays both. Measured on
#: one CPU core per rank (2 nodes at 1 Gbit/s, 12.6M-parameter MLP): counted once, the model put FP8
#: 7% ahead of the bf16 recipe, and the FP8 step took 335 ms against the bf16 hook's 287 (its codec,
#: 92 ms alone, cost ~1.6x that in the step, beside the backward on the same core); counted twice,
#: it picks bf16 there and still FP8 at 0.2 Gbit/s (FP8 1.45x the bf16 hook). On a GPU the codec
#: costs picoseconds per element against nanoseconds of wire, so the weight changes no choice there.
#: The fixed cost (launches, host work on the communication thread) counts once, and so do the bf16
#: recipe's casts: counted twice as well, they sent the buckets of the same model over an unshaped
#: veth plain (predicted 4.30 against 4.43 ns/element) where the bf16 hook's step was 7% faster
#: (146 against 158 ms); counted once, bf16 is chosen there (3.48 ns/element).
CODEC_WEIGHT = 2.0


@dataclasses.dataclass(frozen=True)
class Figures:
    """What the cost model needs, in seconds: a collective's fixed cost and an all-reduce's cost per
    byte of the tensor, the codec's fixed cost per bucket and its cost per element, and the bf16
    recipe's cost per element (both casts and the division; 0 where not measured) and a bf16
    all-reduce's cost per element (negative where not measured: then twice ``s_per_byte``)."""

    latency_s: float
    s_per_byte: float
    codec_fixed_s: float
    codec_s_per_elem: float
    cast_s_per_elem: float = 0.0
    bf16_s_per_elem: float = -1.0

    def as_list(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> "Figures":
        return cls(*(float(v) for v in values))


def fit_line(x1: float, t1: float, x2: float, t2: float) -> Tuple[float, float]:
    """``(fixed, per_unit)`` of the line through two timings ``t1`` at size ``x1`` and ``t2`` at
    ``x2 > x1``, neither below 0 (a noisy pair that slopes down means a cost per unit of 0, all of it
    fixed; a line through negative time at size 0 means no fixed cost)."""
    if not x2 > x1:
        raise ValueError(f"fit_line needs x2 > x1, got {x1} and {x2}")
    per_unit = max((t2 - t1) / (x2 - x1), 0.0)
    fixed = max(t1 - per_unit * x1, 0.0)
    if per_unit == 0.0:
        fixed = max(t1, t2)
    return fixed, per_unit


def combine(per_rank: Sequence[Figures]) -> Figures:
    """The figures every rank decides with: each figure's maximum over ranks (the slowest rank sets
    the pace of a collective). What one MAX all-reduce computes in :func:`measure`."""
    if not per_rank:
        raise ValueError("combine needs the figures of at least one rank")
    return Figures.from_list([max(col) for col in zip(*(f.as_list() for f in per_rank))])


def fp8_bytes_per_elem(scaling: str, block_size: int) -> float:
    """Bytes of a packed FP8 bucket per element: one payload byte, plus one fp32 scale per block
    (``block`` scaling); per-parameter or per-shard scales (``tensor``, ``bucket``) are negligible."""
    return 1.0 + (4.0 / block_size if scaling == "block" else 0.0)


def predict_plain_s(f: Figures, numel: int, element_size: int) -> float:
    """Predicted time of a plain all-reduce of ``numel`` elements of ``element_size`` bytes."""
    return f.latency_s + f.s_per_byte * numel * element_size


def predict_two_shot_s(f: Figures, numel: int, fp8_bpe: float) -> float:
    """Predicted cost in a step of FP8 ``two_shot`` of ``numel`` elements (``fp8_bpe`` packed bytes
    each): the wire plus the codec's local work, its cost per element counted
    :data:`CODEC_WEIGHT` times."""
    return (2 * f.latency_s + f.s_per_byte * numel * fp8_bpe + f.codec_fixed_s
            + CODEC_WEIGHT * f.codec_s_per_elem * numel)


def predict_cast_s(f: Figures, numel: int) -> float:
    """Predicted cost in a step of the bf16 recipe on ``numel`` elements: a bf16 all-reduce plus the
    casts."""
    wire = f.bf16_s_per_elem if f.bf16_s_per_elem >= 0 else 2 * f.s_per_byte
    return f.latency_s + wire * numel + f.cast_s_per_elem * numel


def choose(f: Figures, numel: int, element_size: int, fp8_bpe: float, cast: bool = False) -> str:
    """The mode the model predicts fastest: ``"two_shot"``, ``"bf16"`` (only with ``cast`` and
    ``element_size`` > 2) or ``"none"``; a mode must be strictly faster than the plain all-reduce
    (and FP8 strictly faster than bf16) to be chosen. A pure function of its arguments: ranks with
    the same figures choose alike."""
    best, t_best = "none", predict_plain_s(f, numel, element_size)
    if cast and element_size > 2:
        t = predict_cast_s(f, numel)
        if t < t_best:
            best, t_best = "bf16", t
    if predict_two_shot_s(f, numel, fp8_bpe) < t_best:
        best = "two_shot"
    return best


def break_even_numel(f: Figures, element_size: int, fp8_bpe: float) -> Optional[int]:
    """The smallest bucket (elements) from which FP8 is predicted faster, or None when it never is
    (the bytes saved per element do not pay for the codec's cost per element)."""
    gain = f.s_per_byte * (element_size - fp8_bpe) - CODEC_WEIGHT * f.codec_s_per_elem
    if gain <= 0:
        return None
    return int((f.latency_s + f.codec_fixed_s) / gain) + 1


class AutoPlan:
    """The choice per bucket for ``algorithm="auto"``: call it with ``(numel, element_size)`` to get
    ``"two_shot"``, ``"bf16"`` (only when built with ``cast=True``: the group sums bf16) or
    ``"none"``; the first time a bucket size is seen its choice and the predictions are logged and
    kept (:meth:`report`)."""

    __slots__ = ("figures", "world_size", "fp8_bpe", "cast", "_decisions")

    def __init__(self, figures: Figures, world_size: int, fp8_bpe: float, cast: bool = False):
        self.figures, self.world_size, self.fp8_bpe, self.cast = figures, world_size, fp8_bpe, bool(cast)
        self._decisions: Dict[Tuple[int, int], Tuple[str, float, float, Optional[float]]] = {}

    def __call__(self, numel: int, element_size: int) -> str:
        d = self._decisions.get((numel, element_size))
        if d is None:
            f = self.figures
            tc = predict_cast_s(f, numel) if self.cast and element_size > 2 else None
            d = (choose(f, numel, element_size, self.fp8_bpe, self.cast), predict_two_shot_s(f, numel, self.fp8_bpe),
                 predict_plain_s(f, numel, element_size), tc)
            self._decisions[(numel, element_size)] = d
            log.info("fp8_comm_hook: auto: bucket of %d elements (%d-byte): %s (predicted two_shot %.3f ms, "
                     "plain all-reduce %.3f ms, bf16 %s)", numel, element_size, d[0], d[1] * 1e3, d[2] * 1e3,
                     "-" if tc is None else f"{tc * 1e3:.3f} ms")
        return d[0]

    def always_plain(self, element_sizes, max_numel: Optional[Dict[int, int]] = None) -> bool:
        """Whether every bucket of gradients of these element sizes (bytes) goes plain: FP8 does not
        beat the plain all-reduce below ``max_numel[element size]`` elements (the largest bucket the
        model can form; absent or None: whatever the size, i.e. no break-even size at all) and the
        bf16 recipe, where a candidate, costs no less per element (both share the collective's
        fixed cost)."""
        f = self.figures
        max_numel = max_numel or {}
        for e in element_sizes:
            be, cap = break_even_numel(f, e, self.fp8_bpe), max_numel.get(e)
            if be is not None and (cap is None or be <= cap):
                return False
            if self.cast and e > 2 and predict_cast_s(f, 1) - f.latency_s < f.s_per_byte * e:
                return False
        return True

    def report(self) -> dict:
        """The figures, the break-even bucket sizes for 4- and 2-byte gradients (None: never), and
        each bucket size seen so far with its choice and both predictions (ms)."""
        return {"figures": dataclasses.asdict(self.figures), "codec_weight": CODEC_WEIGHT,
                "world_size": self.world_size,
                "fp8_bytes_per_elem": self.fp8_bpe,
                "break_even_numel": {"fp32": break_even_numel(self.figures, 4, self.fp8_bpe),
                                     "bf16": break_even_numel(self.figures, 2, self.fp8_bpe)},
                "bf16_allowed": self.cast,
                "buckets": [{"numel": n, "element_size": e, "mode": m, "predicted_two_shot_ms": t8 * 1e3,
                             "predicted_plain_ms": tp * 1e3,
                             "predicted_bf16_ms": None if tc is None else tc * 1e3}
                            for (n, e), (m, t8, tp, tc) in sorted(self._decisions.items())]}


# ---------------------------------------------------------------------------------- measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_codec(codec, config, numel: int, world_size: int, rank: int, device: torch.device,
               repeats: int = REPEATS) -> float:
    """Seconds (the fastest of ``repeats``) of two_shot's local work on one ``numel``-element fp32 bucket: encode, the
    owner's dequantize-sum-requantize and decode (the exchanges replaced by local copies of the same
    bytes), with error feedback when the config has it. One untimed run first (kernel compilation)."""
    L = BucketLayout([numel], [0], ["autotune"], world_size, rank, config.block_size, config.scaling, numel,
                     torch.float32, device)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
    residual = L.ensure_residual() if config.error_feedback else None

    def once():
        codec.encode(flat, L, residual, None)
        L.recv.copy_(L.send)
        codec.reduce_shard(L, residual, None)
        L.gather_out.copy_(L.gather_in[None].expand_as(L.gather_out))
        codec.decode(L, flat)

    return _fastest(once, device, repeats)


def _fastest(once, device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` timed calls of ``once()`` (the device synchronised
    around each), after one untimed call (kernel compilation, first-touch allocation)."""
    once()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def time_cast(numel: int, world_size: int, device: torch.device, repeats: int = REPEATS) -> float:
    """Seconds (the fastest of ``repeats``) of the bf16 recipe's local work on ``numel`` fp32
    elements: cast to bf16, divide by W, cast back into the bucket (the all-reduce left out)."""
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)

    def once():
        flat.copy_(flat.to(torch.bfloat16).div_(world_size))

    return _fastest(once, device, repeats)


def slowest_rank_s(seconds: float, group, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (one MAX all-reduce: a collective)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    return float(collectives.all_reduce_max(t, group)[0])


def measure_local(state, device: torch.device, all_reduce_sizes: Sequence[int] = ALL_REDUCE_SIZES,
                  codec_sizes: Sequence[int] = CODEC_SIZES, repeats: int = REPEATS) -> Figures:
    """This rank's figures: fp32 all-reduces of two sizes on the state's group (a collective: every
    rank of the group must call it at the same point; the larger grows until it takes
    ``SUSTAINED_S`` on the slowest rank, see ``MAX_ALL_REDUCE``), bf16 all-reduces of the same sizes
    where the group sums bf16 (else ``bf16_s_per_elem`` is -1), the codec and the bf16 recipe's
    casts at two sizes on ``device``."""
    (n1, n2), (c1, c2) = sorted(all_reduce_sizes), sorted(codec_sizes)
    t1 = collectives.time_all_reduce(n1, state.group, device, repeats)
    t2 = collectives.time_all_reduce(n2, state.group, device, repeats)
    # every rank decides on the same (slowest) time, so every rank runs the same all-reduces
    while n2 < MAX_ALL_REDUCE and slowest_rank_s(t2, state.group, device) < SUSTAINED_S:
        n2 = min(4 * n2, MAX_ALL_REDUCE)
        t2 = collectives.time_all_reduce(n2, state.group, device, repeats)
    latency, per_byte = fit_line(4 * n1, t1, 4 * n2, t2)
    if per_byte == 0.0:
        # The larger all-reduce was not measurably slower than the smaller one (noise on a shared
        # host): no line fits; take the larger one's time as all bandwidth, which never rates the
        # link faster than it measured (a zero cost per byte would make every bucket go plain).
        latency, per_byte = 0.0, t2 / (4 * n2)
    bf16_per_elem = -1.0
    if collectives.bf16_all_reduce_works(state.group, device):   # the same answer on every rank
        b1 = collectives.time_all_reduce(n1, state.group, device, repeats, torch.bfloat16)
        b2 = collectives.time_all_reduce(n2, state.group, device, repeats, torch.bfloat16)
        bf16_per_elem = fit_line(n1, b1, n2, b2)[1] or b2 / n2
    codec = state.codec_for(device)
    k1 = time_codec(codec, state.config, c1, state.world_size, state.rank, device, repeats)
    k2 = time_codec(codec, state.config, c2, state.world_size, state.rank, device, repeats)
    fixed, per_elem = fit_line(c1, k1, c2, k2)
    _, cast_per_elem = fit_line(c1, time_cast(c1, state.world_size, device, repeats),
                                c2, time_cast(c2, state.world_size, device, repeats))
    return Figures(latency, per_byte, fixed, per_elem, cast_per_elem, bf16_per_elem)


def measure(state, device: torch.device, **kw) -> Figures:
    """:func:`measure_local` on every rank, combined by one MAX all-reduce (:func:`combine`): the
    same figures on every rank. A collective: call it on every rank of the state's group."""
    mine = measure_local(state, device, **kw)
    t = torch.tensor(mine.as_list(), dtype=torch.float64, device=device)
    return Figures.from_list(collectives.all_reduce_max(t, state.group).cpu().tolist())


def tune(state, device: Optional[torch.device] = None, **kw) -> AutoPlan:
    """Measure (:func:`measure`; gradients on ``device``, default CPU) and give ``state`` the
    resulting :class:`AutoPlan` (``state.set_auto_plan``); logs the figures and the break-even
    bucket sizes. A collective: call it on every rank of the state's group at the same point.
    Returns the plan."""
    device = torch.device(device if device is not None else "cpu")
    if state.ddp_native_all_reduce:
        log.warning("fp8_comm_hook: auto: this state's DDP model runs DDP's own all-reduce (at registration no "
                    "bucket size was predicted to gain from FP8 or bf16, so no hook was registered); a new plan "
                    "takes effect only through register_ddp_hook on a new DDP model")
    f = measure(state, device, **kw)
    cfg = state.config
    cast = f.bf16_s_per_elem >= 0   # measured only where the group sums bf16
    plan = AutoPlan(f, state.world_size, fp8_bytes_per_elem(cfg.scaling, cfg.block_size), cast)
    state.set_auto_plan(plan)
    be = plan.report()["break_even_numel"]
    log.info("fp8_comm_hook: auto: collective latency %.1f us, all-reduce %.3f GB/s of tensor, codec %.1f us + "
             "%.2f ns/element, %s (max over %d ranks); two_shot beats the plain "
             "all-reduce from %s elements (fp32 buckets), %s (bf16)",
             f.latency_s * 1e6, 1e-9 / f.s_per_byte if f.s_per_byte > 0 else float("inf"), f.codec_fixed_s * 1e6,
             f.codec_s_per_elem * 1e9,
             f"bf16 all-reduce {f.bf16_s_per_elem * 1e9:.2f} ns/element + casts {f.cast_s_per_elem * 1e9:.2f} ns/element"
             if cast else "the group cannot sum bf16 (bf16 not a candidate)",
             state.world_size, be["fp32"] or "never", be["bf16"] or "never")
    return plan
