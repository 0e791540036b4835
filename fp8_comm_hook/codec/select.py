"""Backend choice: ``backend="auto"`` resolves to torch on CPU; on CUDA to the faster of Triton and
Transformer Engine for the scaling mode, as measured on one H200 (``FASTER_ON_GPU``, checked against
``benchmarks/results/codec-h200.json`` by the tests), falling back to whichever of the two imports.
The choice is logged once per process."""
import functools
import importlib.util
import logging

import torch

from ..formats import get_format

__all__ = ["get_codec", "resolve_backend", "te_available", "triton_available"]

log = logging.getLogger("fp8_comm_hook")

# The faster GPU backend per scaling mode: the smaller sum of the GPU times of encode, reduce_shard
# and decode for a 6.55M-element fp32 bucket at W = 8 in benchmarks/results/codec-h200.json (TE
# serves tensor and bucket scaling only). tests/test_codec.py recomputes it from that file.
FASTER_ON_GPU = {"block": "triton", "tensor": "triton", "bucket": "triton"}
_logged = set()


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # a broken install must not break the package
        return False


@functools.lru_cache(maxsize=None)
def te_available() -> bool:
    """True when Transformer Engine's torch extension imports (it raises RuntimeError, not
    ImportError, without CUDA libraries)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch  # noqa: F401
        return True
    except Exception:
        return False


def resolve_backend(config, device: torch.device) -> str:
    """The concrete backend ("torch", "triton" or "te") for ``config`` on ``device``; raises
    ``ValueError`` for an explicit backend that cannot run there."""
    device = torch.device(device)
    b = config.backend
    if b == "auto":
        if device.type != "cuda":
            b = "torch"
        else:
            te_ok = config.scaling in ("tensor", "bucket") and not config.stochastic_rounding and te_available()
            tr_ok = triton_available()
            if te_ok and (FASTER_ON_GPU.get(config.scaling) == "te" or not tr_ok):
                b = "te"
            elif tr_ok:
                b = "triton"
            else:
                b = "torch"
        key = (b, config.scaling, device.type)
        if key not in _logged:
            _logged.add(key)
            log.info("fp8_comm_hook: backend=auto chose %r for scaling=%r on %s", b, config.scaling, device.type)
        return b
    if b in ("triton", "te") and device.type != "cuda":
        raise ValueError(f"backend={b!r} needs a CUDA device, the gradients are on {device}; use 'torch' or 'auto'")
    if b == "triton" and not triton_available():
        raise ValueError("backend='triton' needs Triton installed; use 'torch' or 'auto'")
    if b == "te":
        if not te_available():
            raise ValueError("backend='te' needs Transformer Engine (pip install 'fp8_comm_hook[te]'); use 'auto'")
        if config.stochastic_rounding:
            raise ValueError("stochastic_rounding=True is not available with backend='te' (TE has no FP8 "
                             "stochastic rounding); use backend='torch' or 'triton'")
        if config.scaling == "block":
            raise ValueError("backend='te' supports scaling='tensor' and 'bucket' only (no Transformer Engine "
                             "quantizer is verified to write the per-block wire format); use backend='triton' "
                             "or 'auto' for scaling='block'")
    return b


def get_codec(config, device):
    """Build the codec for ``config`` on ``device`` (see :func:`resolve_backend`)."""
    fmt = get_format(config.fp8_format)
    b = resolve_backend(config, device)
    if b == "torch":
        from .torch_codec import TorchCodec
        return TorchCodec(fmt, stochastic_rounding=config.stochastic_rounding)
    if b == "triton":
        from .triton_codec import TritonCodec
        return TritonCodec(fmt, stochastic_rounding=config.stochastic_rounding)
    from .te_codec import TECodec
    return TECodec(fmt)
