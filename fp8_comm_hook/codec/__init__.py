"""FP8 codecs: quantize, dequantize and dequantize-sum over a :class:`~fp8_comm_hook.geometry.ScaleGroups`
geometry, writing the normative wire format (docs/design.md, "Wire format").

Backends: ``torch`` (reference; CPU and GPU), ``triton`` (fused GPU kernels) and ``te``
(Transformer Engine). :func:`get_codec` picks one for a config and device.
"""
from .base import Codec, compute_scales
from .select import get_codec, resolve_backend
from .torch_codec import TorchCodec

__all__ = ["Codec", "TorchCodec", "compute_scales", "get_codec", "resolve_backend"]
