"""Command-line integration: one flag (``--grad-comm fp8``) turns FP8 gradient communication on in a
trainer, and ``--fp8-*`` flags set every :class:`FP8CommConfig` field.

Precedence, per field: the command-line flag, then the environment variable ``FP8_COMM_<FIELD>``,
then the :class:`FP8CommConfig` default. ``--grad-comm`` falls back to ``FP8_COMM_GRAD_COMM``, then
``"none"``. A bad value raises ``ValueError`` naming the flag or the variable it came from.

Example::

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args()
    model = DDP(net)
    state = register_grad_comm(model, grad_comm_from_args(args), config_from_args(args))

The bf16 baseline hooks themselves are in :mod:`fp8_comm_hook.cast_hook`.
"""
import argparse
import dataclasses
import logging
import os
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from .. import registry
from ..cast_hook import bf16_allreduce_hook, bf16_emulated_hook
from ..collectives import bf16_all_reduce_works
from ..config import ALGORITHMS, BACKENDS, ENV_PREFIX, FP8_FORMATS, SCALINGS, FP8CommConfig, _parse_field
from ..ddp import register_ddp_hook
from ..state import FP8CommState

__all__ = ["GRAD_COMMS", "GRAD_COMM_ENV", "FLAGS", "add_cli_args", "grad_comm_from_args", "config_from_args",
           "register_grad_comm"]

log = logging.getLogger("fp8_comm_hook")

#: What ``--grad-comm`` accepts: a plain fp32 all-reduce, a bf16 all-reduce, or FP8 through this package.
GRAD_COMMS = ("none", "bf16", "fp8")
GRAD_COMM_ENV = ENV_PREFIX + "GRAD_COMM"

_DEFAULTS = FP8CommConfig()

#: FP8CommConfig field -> (flag, argparse dest, metavar, help). Booleans get ``--no-<flag>`` too.
FLAGS = {
    "fp8_format": ("--fp8-format", "fp8_format", "{" + ",".join(FP8_FORMATS) + "}",
                   "FP8 format on the wire: e4m3 (more precision, max 448) or e5m2 (more range, max 57344)"),
    "scaling": ("--fp8-scaling", "fp8_scaling", "{" + ",".join(SCALINGS) + "}",
                "scale granularity: one fp32 scale per block, per parameter segment (tensor) or per shard (bucket)"),
    "block_size": ("--fp8-block-size", "fp8_block_size", "N",
                   "elements per scaling block, a power of two in [16, 8192]"),
    "algorithm": ("--fp8-algorithm", "fp8_algorithm", "{" + ",".join(ALGORITHMS) + "}",
                  "wire algorithm: two_shot (all-to-all + all-gather; gloo and NCCL), nccl_fp8 (FP8 SUM "
                  "all-reduce; NCCL on sm90+), none (plain all-reduce) or auto"),
    "backend": ("--fp8-backend", "fp8_backend", "{" + ",".join(BACKENDS) + "}",
                "codec kernels: torch, triton, te, or auto (torch on CPU; TE or Triton on CUDA)"),
    "min_compress_numel": ("--fp8-min-compress-numel", "fp8_min_compress_numel", "N",
                           "buckets with fewer elements go uncompressed; 0 compresses every bucket"),
    "pre_scale": ("--fp8-pre-scale", "fp8_pre_scale", "X",
                  "factor in (0, 1] applied before the FP8 sum (nccl_fp8 only); 'none' means 1/sqrt(world)"),
    "error_feedback": ("--fp8-error-feedback", "fp8_error_feedback", None,
                       "carry each rank's quantization error into the next step"),
    "stochastic_rounding": ("--fp8-stochastic-rounding", "fp8_stochastic_rounding", None,
                            "round stochastically (unbiased) instead of round-to-nearest-even"),
    "seed": ("--fp8-seed", "fp8_seed", "N", "seed of the stochastic-rounding generator"),
    "warmup_steps": ("--fp8-warmup-steps", "fp8_warmup_steps", "N",
                     "the first N steps send gradients uncompressed"),
}
_BOOL_FIELDS = ("error_feedback", "stochastic_rounding")


def _env_var(field: str) -> str:
    return ENV_PREFIX + field.upper()


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--grad-comm`` and the ``--fp8-*`` flags (one per :class:`FP8CommConfig` field) to
    ``parser`` in their own argument group; every default is None (meaning: environment variable,
    then config default). Returns ``parser``."""
    g = parser.add_argument_group(
        "gradient communication",
        f"Each --fp8-* flag overrides the environment variable {ENV_PREFIX}<FIELD>, which overrides the "
        "FP8CommConfig default shown.")
    g.add_argument("--grad-comm", dest="grad_comm", default=None, metavar="{" + ",".join(GRAD_COMMS) + "}",
                   help="gradient all-reduce: none (plain fp32), bf16 (torch's bf16_compress_hook) or fp8 "
                        f"(this package's hook); default: ${GRAD_COMM_ENV}, else none")
    for field, (flag, dest, metavar, text) in FLAGS.items():
        default = getattr(_DEFAULTS, field)
        shown = repr(default) if isinstance(default, str) else str(default)
        help_text = f"{text} (FP8CommConfig.{field}, default {shown}; env {_env_var(field)})"
        if field in _BOOL_FIELDS:
            g.add_argument(flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            g.add_argument(flag, dest=dest, default=None, metavar=metavar, help=help_text)
    return parser


def grad_comm_from_args(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> str:
    """The gradient communication mode: ``args.grad_comm`` if given, else ``$FP8_COMM_GRAD_COMM``,
    else ``"none"``. Raises ``ValueError`` naming the flag or variable for a value not in
    :data:`GRAD_COMMS`."""
    environ = os.environ if environ is None else environ
    value = getattr(args, "grad_comm", None)
    source = "--grad-comm"
    if value is None:
        if GRAD_COMM_ENV not in environ:
            return "none"
        value, source = environ[GRAD_COMM_ENV], f"environment variable {GRAD_COMM_ENV}"
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in GRAD_COMMS:
        raise ValueError(f"{source}={value!r}: must be one of {list(GRAD_COMMS)}")
    return text


def _parse_value(field: str, value: Any, source: str) -> Any:
    """Parse the string form of ``field`` (other values pass as they are); errors name ``source``."""
    if not isinstance(value, str):
        return value
    try:
        return _parse_field(field, value)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def config_from_args(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None,
                     base: Optional[FP8CommConfig] = None) -> FP8CommConfig:
    """Build an :class:`FP8CommConfig` from parsed ``args`` (see :func:`add_cli_args`): each field
    from its ``--fp8-*`` flag if given, else from ``FP8_COMM_<FIELD>`` in ``environ`` (default
    ``os.environ``), else from ``base`` (default: the config defaults). Flags missing from ``args``
    count as not given. Raises ``ValueError`` naming the flag or variable of a bad value."""
    environ = os.environ if environ is None else environ
    values = dataclasses.asdict(base) if base is not None else {}
    sources = {}
    for field, (flag, dest, _, _) in FLAGS.items():
        given = getattr(args, dest, None)
        var = _env_var(field)
        if given is not None:
            if field in _BOOL_FIELDS and isinstance(given, bool):
                source = flag if given else "--no-" + flag[2:]
            else:
                source = f"{flag} {given if isinstance(given, str) else repr(given)}"
            values[field] = _parse_value(field, given, source)
        elif var in environ:
            source = f"environment variable {var}={environ[var]!r}"
            values[field] = _parse_value(field, environ[var], source)
        else:
            continue
        sources[field] = source
    try:
        return FP8CommConfig(**values)
    except ValueError as e:
        msg = str(e)
        for field, source in sources.items():  # validation messages start with the field's name
            if msg.startswith(field + " "):
                raise ValueError(f"{source}: {msg}") from None
        raise ValueError(f"{msg} (from {', '.join(sources.values()) or 'defaults'})") from None


def register_grad_comm(ddp_model: torch.nn.parallel.DistributedDataParallel, grad_comm: str,
                       config: Optional[FP8CommConfig] = None) -> Optional[FP8CommState]:
    """Set up ``ddp_model``'s gradient communication for ``grad_comm`` (one of :data:`GRAD_COMMS`):

    - ``"none"``: registers nothing (DDP's own fp32 all-reduce); returns None.
    - ``"bf16"``: on NCCL, torch's ``default_hooks.bf16_compress_hook``; on other backends that can
      all-reduce bf16 (gloo; probed once), :func:`bf16_allreduce_hook`, the same recipe; else
      :func:`bf16_emulated_hook` (bf16 numerics, fp32 on the wire). Logs which; returns None.
    - ``"fp8"``: :func:`fp8_comm_hook.register_ddp_hook` with ``config``; returns its state.

    Records the dtype that goes on the wire for "none"/"bf16" (None for "fp8", whose state counts its
    own bytes): :func:`fp8_comm_hook.registry.grad_comm_wire_dtype` returns it.

    Example::

        args = add_cli_args(argparse.ArgumentParser()).parse_args()
        state = register_grad_comm(DDP(net), grad_comm_from_args(args), config_from_args(args))
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_grad_comm needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if grad_comm not in GRAD_COMMS:
        raise ValueError(f"grad_comm must be one of {list(GRAD_COMMS)}, got {grad_comm!r}")
    pg = ddp_model.process_group
    if grad_comm == "none":
        registry.record_wire_dtype(ddp_model, torch.float32)
        log.info("fp8_comm_hook: grad_comm=none: DDP's plain fp32 all-reduce, no hook registered")
        return None
    if grad_comm == "fp8":
        registry.record_wire_dtype(ddp_model, None)
        return register_ddp_hook(ddp_model, config)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    backend = dist.get_backend(pg)
    if backend == "nccl":
        ddp_model.register_comm_hook(pg, default_hooks.bf16_compress_hook)
        registry.record_wire_dtype(ddp_model, torch.bfloat16)
        log.info("fp8_comm_hook: grad_comm=bf16: torch's bf16_compress_hook on nccl")
    elif bf16_all_reduce_works(pg, registry.model_device(ddp_model)):
        ddp_model.register_comm_hook(pg, bf16_allreduce_hook)
        registry.record_wire_dtype(ddp_model, torch.bfloat16)
        log.info("fp8_comm_hook: grad_comm=bf16: torch's bf16_compress_hook is NCCL-only; using bf16_allreduce_hook "
                 "(the same cast, divide, bf16 all-reduce, cast back) on %s", backend)
    else:
        ddp_model.register_comm_hook(pg, bf16_emulated_hook)
        registry.record_wire_dtype(ddp_model, torch.float32)
        log.warning("fp8_comm_hook: grad_comm=bf16: backend %r cannot all-reduce bf16; using bf16_emulated_hook "
                    "(bf16-rounded values summed in fp32: bf16 numerics, fp32 bytes on the wire)", backend)
    return None
