"""Transformer Engine backend: TE's FP8 cast kernels for tensor and bucket scaling.

The wire rule decides the scale, TE only casts: group amaxes come from the torch reference (it maps
NaN to +Inf; TE's amax would not, and TE's cast saturates an Inf to +-fmax, hiding it), the scales
from :func:`compute_scales` (non-finite groups get ``scale_inv = NaN``), and every scale group is
cast by ``tex.quantize`` with a ``Float8Quantizer`` holding that group's scale, writing straight into
the packed send buffer. Finite values scaled by ``fmax / amax`` are within range, where TE's
saturating RNE cast and the reference's clamp-then-RNE agree, so the bytes are the reference's.
Dequantization is the reference's (eager torch).

Block scaling is refused: no TE quantizer is verified to produce this wire format per block.
"""
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ..geometry import ScaleGroups
from .base import compute_scales
from .torch_codec import TorchCodec

__all__ = ["TECodec", "te_import_error"]

tex = Float8Quantizer = _Float8Storage = None
_TE_ERROR: Optional[BaseException] = None
try:  # transformer_engine raises RuntimeError, not ImportError, without CUDA libraries
    import transformer_engine.pytorch  # noqa: F401  (loads and registers the torch extension)
    import transformer_engine_torch as tex
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    except Exception:
        from transformer_engine.pytorch import Float8Quantizer
    try:
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
            Float8TensorStorage as _Float8Storage)
    except Exception:
        try:
            from transformer_engine.pytorch.tensor._internal.float8_tensor_base import (
                Float8TensorBase as _Float8Storage)
        except Exception:
            _Float8Storage = None
except Exception as e:  # pragma: no cover - depends on the machine
    tex = Float8Quantizer = _Float8Storage = None
    _TE_ERROR = e

_CACHE_PER_GEOMETRY = 4


def te_import_error() -> Optional[BaseException]:
    """Why Transformer Engine could not be imported (None when it was)."""
    return _TE_ERROR


class TECodec(TorchCodec):
    """FP8 codec that casts with Transformer Engine (tensor and bucket scaling only).

    One ``tex.quantize`` launch per scale group (per row for bucket scaling, per parameter segment
    of a row for tensor scaling) into preallocated payload views; amax, scales and dequantization
    follow the torch reference, so the bytes equal :class:`TorchCodec`'s.
    """

    name = "te"

    def __init__(self, fmt):
        if tex is None:
            raise ValueError(f"backend='te' needs Transformer Engine, which failed to import: {_TE_ERROR!r}")
        super().__init__(fmt, stochastic_rounding=False)
        self._te_dtype = tex.DType.kFloat8E4M3 if fmt.name == "e4m3" else tex.DType.kFloat8E5M2
        self._scratch: Dict[torch.device, torch.Tensor] = {}
        # Workspaces per scale-group geometry, dropped with it: the group ranges, and the casts
        # (source view, quantizer, destination) per set of buffers.
        self._ranges_by_groups: "weakref.WeakKeyDictionary[ScaleGroups, list]" = weakref.WeakKeyDictionary()
        self._casts_by_groups: "weakref.WeakKeyDictionary[ScaleGroups, dict]" = weakref.WeakKeyDictionary()

    def _scratch_for(self, device) -> torch.Tensor:
        """Two fp32 words TE writes and nobody reads (its amax and its scale_inv)."""
        s = self._scratch.get(device)
        if s is None:
            s = self._scratch[device] = torch.zeros(2, dtype=torch.float32, device=device)
        return s

    def _ranges(self, groups: ScaleGroups) -> List[Tuple[int, int, int, int]]:
        """(row, local group, start, end) element ranges of every non-empty group, derived once per
        geometry (one host copy of ``block_group``)."""
        cached = self._ranges_by_groups.get(groups)
        if cached is not None:
            return cached
        bpc, bs, G = groups.chunk_numel // groups.block_size, groups.block_size, groups.groups_per_row
        bg = groups.block_group.detach().to("cpu", torch.int64).view(groups.rows, bpc)
        out = []
        for r in range(groups.rows):
            local = (bg[r] - r * G).tolist()
            start = 0
            for i in range(1, bpc + 1):
                if i == bpc or local[i] != local[start]:
                    out.append((r, int(local[start]), start * bs, i * bs))
                    start = i
        self._ranges_by_groups[groups] = out
        return out

    def _casts(self, x, groups: ScaleGroups, payload, group_scale):
        """The (source view, quantizer, destination) triple of every group, built once per set of
        buffers per geometry (the views keep those buffers alive)."""
        key = (x.data_ptr(), payload.data_ptr(), payload.stride(0), group_scale.data_ptr(), x.device)
        cache = self._casts_by_groups.get(groups)
        if cache is None:
            cache = self._casts_by_groups[groups] = {}
        plan = cache.get(key)
        if plan is not None:
            return plan
        if len(cache) >= _CACHE_PER_GEOMETRY:
            cache.clear()
        C, G = groups.chunk_numel, groups.groups_per_row
        scratch = self._scratch_for(x.device)
        plan = []
        for r, gl, start, end in self._ranges(groups):
            g = r * G + gl
            q = Float8Quantizer(scale=group_scale[g:g + 1], amax=scratch[0:1], fp8_dtype=self._te_dtype,
                                rowwise=True, columnwise=False)
            src = x[r * C + start:r * C + end]
            dst_u8 = payload[r, start:end]
            plan.append((src, q, self._wrap(dst_u8, scratch[1:2], q), dst_u8))
        cache[key] = plan
        return plan

    def _wrap(self, data: torch.Tensor, scale_inv: torch.Tensor, quantizer):
        """A TE FP8 storage object around our uint8 buffer, so ``tex.quantize`` writes into it; None
        when this TE version has no such class or constructor (then TE allocates and we copy)."""
        if _Float8Storage is None:
            return None
        try:
            return _Float8Storage(data=data, fp8_scale_inv=scale_inv, fp8_dtype=self._te_dtype,
                                  data_transpose=None, quantizer=quantizer)
        except Exception:
            return None

    def quantize_with_amax(self, x, groups: ScaleGroups, amax, payload, scale_inv, *, pre_scale, work,
                           group_scale, block_scale, generator: Optional[torch.Generator] = None):
        """Scales by the wire rule (torch), then one TE cast per scale group into ``payload``."""
        if groups.block_group is None:
            raise ValueError("backend='te' supports scaling='tensor' and 'bucket' only: no Transformer Engine "
                             "quantizer is verified to write this wire format per block; use backend='triton' "
                             "(or 'torch'/'auto') for scaling='block'")
        rows, G = groups.rows, groups.num_groups
        gs = group_scale[:G]
        tmp = block_scale[:G]
        compute_scales(amax[:G], self.fmt.fmax, pre_scale, gs, tmp)
        scale_inv.copy_(tmp.view(rows, -1))
        if payload.dim() == 1:
            payload = payload.view(rows, -1)
        for src, q, dst, dst_u8 in self._casts(x, groups, payload, group_scale):
            if dst is not None:
                tex.quantize(src, q, dst, None)
            else:  # no storage class to wrap our buffer: let TE allocate, then copy the bytes
                out = tex.quantize(src, q, None, None)
                dst_u8.copy_(out._data.view(torch.uint8))
