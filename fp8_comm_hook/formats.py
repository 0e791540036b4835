"""FP8 formats: the torch dtype, the largest finite value and the bit width of each.

Nothing else in the package hard-codes 448 or 57344; it asks this module.
"""
import dataclasses

import torch

__all__ = ["FP8Format", "get_format", "FORMATS", "FLOAT32_MAX"]

#: Largest finite fp32 value; quantization scales are clamped to it so that a tiny (denormal) amax
#: gives a huge but finite scale instead of Inf.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding: ``name`` ("e4m3"/"e5m2"), its torch ``dtype``, ``fmax`` (largest finite
    magnitude), ``bits`` (8) and the number of mantissa bits ``mantissa_bits``."""

    name: str
    dtype: torch.dtype
    fmax: float
    mantissa_bits: int
    bits: int = 8


FORMATS = {
    "e4m3": FP8Format("e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max), 3),
    "e5m2": FP8Format("e5m2", torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max), 2),
}


def get_format(name: str) -> FP8Format:
    """Return the :class:`FP8Format` called ``name`` ("e4m3" or "e5m2"); ``ValueError`` otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"fp8_format must be one of {sorted(FORMATS)}, got {name!r}") from None
