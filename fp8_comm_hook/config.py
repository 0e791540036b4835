"""``FP8CommConfig``: every knob of FP8 gradient communication, validated once.

Build it from keyword arguments, a dict (:meth:`FP8CommConfig.from_dict`), environment variables
(:meth:`FP8CommConfig.from_env`, ``FP8_COMM_<FIELD>``); command-line flags build it through
:func:`fp8_comm_hook.integrations.cli.config_from_args`. Pure data: nothing here imports the rest of
the package.
"""
import dataclasses
import math
import os
from typing import Any, Mapping, Optional

__all__ = ["FP8CommConfig", "ENV_PREFIX", "env_switch"]

ENV_PREFIX = "FP8_COMM_"

FP8_FORMATS = ("e4m3", "e5m2")
SCALINGS = ("block", "tensor", "bucket")
ALGORITHMS = ("two_shot", "nccl_fp8", "none", "auto")
BACKENDS = ("auto", "torch", "triton", "te")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

#: Buckets with fewer elements than this go through a plain all-reduce by default. Measured on an
#: H200 host (scripts/bench_codec.py, hook_cpu_overhead): an FP8 two_shot bucket costs about 0.6 ms
#: more host time than a plain all-reduce (two collectives and the codec launches instead of one
#: collective). FP8 saves 2(W-1)/W * ~2.97 bytes per fp32 element on the wire (5.2 B at W=8), so it
#: breaks even at n = 0.6 ms * link_bandwidth / 5.2 B: about 360K elements on a 25 Gb/s link, 1.4M on
#: 100 Gb/s. 262144 elements (1 MB of fp32, DDP's first bucket) suits the bandwidth-bound links FP8
#: is for; lower it on slower links, raise it on fast ones (docs/design.md, "Choosing min_compress_numel").
DEFAULT_MIN_COMPRESS_NUMEL = 262144


@dataclasses.dataclass(frozen=True)
class FP8CommConfig:
    """Settings for FP8 gradient communication; validated on construction.

    Fields (defaults in brackets):
      fp8_format ["e4m3"]: "e4m3" (more precision, max 448) or "e5m2" (more range, max 57344).
      scaling ["block"]: "block" (one fp32 scale per ``block_size`` elements), "tensor" (one scale
        per parameter segment of a shard) or "bucket" (one scale per shard of the bucket).
      block_size [128]: elements per scaling block; a power of two in [16, 8192]. Every parameter
        starts on a block boundary in every mode.
      algorithm ["two_shot"]: "two_shot" (all-to-all of FP8 chunks, fp32 sum, all-gather of FP8
        shards; gloo and NCCL), "nccl_fp8" (FP8 SUM all-reduce with shared scales; NCCL on sm90+),
        "none" (plain all-reduce) or "auto": per bucket, two_shot or the plain all-reduce in the
        bucket's dtype, whichever a cost model predicts faster; register_ddp_hook times the group's
        all-reduce at two sizes and the codec on the device, combines the figures over ranks (MAX)
        so every rank chooses alike, and logs the choice per bucket size (fp8_comm_hook.autotune;
        state.auto_plan.report()). Without that measurement (FSDP, all_reduce) "auto" is two_shot.
      pre_scale [None]: factor applied before an FP8 sum (nccl_fp8 only); None means 1/sqrt(world).
      backend ["auto"]: codec kernels: "torch", "triton", "te" or "auto" (torch on CPU; on CUDA, TE
        for tensor/bucket scaling when installed, else Triton).
      error_feedback [False]: carry each rank's quantization error to the next step.
      stochastic_rounding [False]: unbiased random rounding to the FP8 grid instead of RNE.
      seed [0]: seed of the stochastic-rounding generator (mixed with the step counter).
      min_compress_numel [262144]: buckets with fewer elements go uncompressed; 0 compresses all.
      warmup_steps [0]: the first N steps go uncompressed.
    """

    fp8_format: str = "e4m3"
    scaling: str = "block"
    block_size: int = 128
    algorithm: str = "two_shot"
    pre_scale: Optional[float] = None
    backend: str = "auto"
    error_feedback: bool = False
    stochastic_rounding: bool = False
    seed: int = 0
    min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL
    warmup_steps: int = 0

    def __post_init__(self):
        _choice("fp8_format", self.fp8_format, FP8_FORMATS)
        _choice("scaling", self.scaling, SCALINGS)
        _choice("algorithm", self.algorithm, ALGORITHMS)
        _choice("backend", self.backend, BACKENDS)
        bs = self.block_size
        if not _is_int(bs) or bs < 16 or bs > 8192 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in [16, 8192], got {bs!r}")
        if self.pre_scale is not None:
            ps = self.pre_scale
            if isinstance(ps, bool) or not isinstance(ps, (int, float)) or not math.isfinite(ps) or not 0 < ps <= 1:
                raise ValueError(f"pre_scale must be None or a number in (0, 1], got {ps!r}")
        for name in ("error_feedback", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("min_compress_numel", "warmup_steps", "seed"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FP8CommConfig":
        """Build from a mapping of field names to values; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown FP8CommConfig field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**dict(d))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, base: Optional["FP8CommConfig"] = None) -> "FP8CommConfig":
        """Build from ``FP8_COMM_<FIELD>`` variables of ``environ`` (default ``os.environ``),
        starting from ``base`` (default: the defaults). A bad value raises ``ValueError`` naming the
        variable, e.g. ``FP8_COMM_FP8_FORMAT=e5m2 FP8_COMM_ERROR_FEEDBACK=1``."""
        environ = os.environ if environ is None else environ
        values = dataclasses.asdict(base) if base is not None else {}
        for f in dataclasses.fields(cls):
            var = ENV_PREFIX + f.name.upper()
            if var in environ:
                try:
                    values[f.name] = _parse_field(f.name, environ[var])
                except ValueError as e:
                    raise ValueError(f"environment variable {var}={environ[var]!r}: {e}") from None
        try:
            return cls(**values)
        except ValueError as e:
            set_vars = [v for v in environ if v.startswith(ENV_PREFIX)]
            raise ValueError(f"{e} (from environment variables {set_vars})") from None

    def replace(self, **changes) -> "FP8CommConfig":
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Return the fields as a plain dict (what :meth:`from_dict` accepts)."""
        return dataclasses.asdict(self)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {list(allowed)}, got {value!r}")


def _parse_field(name: str, text: str):
    """Parse the string form of field ``name`` (used for env vars and the command line)."""
    text = text.strip()
    if name in ("error_feedback", "stochastic_rounding"):
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{name} must be one of {list(_TRUE + _FALSE)}")
    if name in ("block_size", "min_compress_numel", "warmup_steps", "seed"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer") from None
    if name == "pre_scale":
        if text.lower() in ("", "none", "auto"):
            return None
        try:
            return float(text)
        except ValueError:
            raise ValueError("pre_scale must be a number or 'none'") from None
    return text


def env_switch(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A switch that is on unless the environment variable ``name`` says "0", "false", "no" or "off"
    (any case): ``FP8_COMM_CUDA_GRAPHS``, ``FP8_COMM_WORKER``, ``FP8_COMM_AUTO_NATIVE`` (``FP8_COMM_WORKERS``, a count, is read
    by :mod:`fp8_comm_hook.ddp`)."""
    environ = os.environ if environ is None else environ
    return environ.get(name, "1").strip().lower() not in _FALSE
