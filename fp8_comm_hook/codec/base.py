"""The codec interface and the scale rule every backend shares.

Wire rule per scale group with amax a (over the group's elements, in fp32):
  - a finite and > 0: ``scale = min(fmax / a, FLT_MAX)`` (times ``pre_scale`` for an FP8 sum),
    ``q = RNE(clamp(x * scale, -fmax, fmax))``, ``scale_inv = 1 / scale``;
  - a == 0: ``scale = scale_inv = 1``;
  - a non-finite (an Inf or NaN in the group): ``scale_inv = NaN``, so the group dequantizes to NaN
    everywhere; its payload bytes are unspecified.
"""
import abc
from typing import Optional

import torch

from ..formats import FLOAT32_MAX, FP8Format
from ..geometry import ScaleGroups

__all__ = ["Codec", "compute_scales", "keep_finite_", "count_saturated"]


def compute_scales(amax: torch.Tensor, fmax: float, pre_scale: float, scale_out: torch.Tensor,
                   scale_inv_out: torch.Tensor) -> None:
    """Fill ``scale_out`` and ``scale_inv_out`` (fp32, like ``amax``) by the wire rule above."""
    finite = torch.isfinite(amax)
    positive = finite & (amax > 0)
    torch.div(fmax, amax, out=scale_out)
    scale_out.clamp_(max=FLOAT32_MAX)
    if pre_scale != 1.0:
        scale_out.mul_(pre_scale)
    scale_out.masked_fill_(~positive, 1.0)
    torch.reciprocal(scale_out, out=scale_inv_out)
    scale_inv_out.masked_fill_(~finite, float("nan"))


def keep_finite_(residual: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
    """Error feedback's update rule: ``residual = updated`` where ``updated`` is finite; elsewhere
    ``residual`` keeps the value it had before the step. An Inf or NaN in a scale group makes that
    group dequantize to NaN, so its whole update is dropped: the gradient it came with was never
    applied (GradScaler skips the step), and the residual stays finite for the next step. Returns
    ``residual``.

    On the CPU a finite sum of ``updated`` (an Inf or NaN anywhere makes it non-finite) lets the
    common case copy: ``isfinite`` there takes 6.5 ms for 4.2M values on one core, the sum 0.3 ms
    (a finite sum costs no host sync on the CPU; on a GPU the mask stays, without one)."""
    if updated.device.type == "cpu" and bool(torch.isfinite(updated.sum())):
        return residual.copy_(updated)
    return torch.where(torch.isfinite(updated), updated, residual, out=residual)


def count_saturated(wire: torch.Tensor, dequantized: torch.Tensor, fmt, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How many values of an FP8 sum (``wire``, uint8 bytes of ``fmt``) sit at +-fmax, counting only
    scale groups with a finite scale (where ``dequantized``, the same values times scale_inv, is not
    NaN): a group that held an Inf or NaN is reported as non-finite, not as saturation, so it does
    not halve the automatic pre_scale. Returns a device int64 scalar (``out`` when given; no
    synchronisation)."""
    q = wire.reshape(-1).view(fmt.dtype).float()
    mask = (q.abs() >= fmt.fmax) & ~torch.isnan(dequantized[:q.numel()])
    return mask.sum() if out is None else torch.sum(mask.reshape(-1), dim=0, out=out)


class Codec(abc.ABC):
    """Quantizes fp32 rows to FP8 payload + fp32 scale_inv per scale group, and back.

    Shapes: ``x`` and ``out`` are flat fp32 of ``groups.rows * groups.chunk_numel``; ``payload`` is
    uint8 ``[rows, chunk_numel]`` (may be a strided view into a packed buffer); ``scale_inv`` is
    fp32 ``[rows, groups_per_row]`` (may be a view). Scratch comes from the caller (the layout), so
    a step allocates nothing beyond what the layout preallocated.
    """

    name = "abstract"

    def __init__(self, fmt: FP8Format):
        self.fmt = fmt

    @abc.abstractmethod
    def group_amax(self, x: torch.Tensor, groups: ScaleGroups, work: torch.Tensor,
                   block_amax: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the amax of every scale group of ``x`` into ``out`` (NaN reported as +Inf, so a
        MAX all-reduce keeps it); returns ``out``."""

    @abc.abstractmethod
    def quantize_with_amax(self, x: torch.Tensor, groups: ScaleGroups, amax: torch.Tensor,
                           payload: torch.Tensor, scale_inv: torch.Tensor, *, pre_scale: float,
                           work: torch.Tensor, group_scale: torch.Tensor, block_scale: torch.Tensor,
                           generator: Optional[torch.Generator] = None) -> None:
        """Quantize ``x`` with scales derived from the given group ``amax``."""

    def quantize(self, x: torch.Tensor, groups: ScaleGroups, payload: torch.Tensor,
                 scale_inv: torch.Tensor, *, work: torch.Tensor, block_amax: torch.Tensor,
                 group_amax: torch.Tensor, group_scale: torch.Tensor, block_scale: torch.Tensor,
                 generator: Optional[torch.Generator] = None) -> None:
        """Quantize ``x`` with its own per-group scales (amax, then cast)."""
        self.group_amax(x, groups, work, block_amax, group_amax)
        self.quantize_with_amax(x, groups, group_amax, payload, scale_inv, pre_scale=1.0, work=work,
                                group_scale=group_scale, block_scale=block_scale, generator=generator)

    @abc.abstractmethod
    def dequantize(self, payload: torch.Tensor, scale_inv: torch.Tensor, groups: ScaleGroups,
                   out: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
        """``out = q * scale_inv`` per group, in fp32; returns ``out``."""

    # ------------------------------------------------------------------ two_shot's three stages
    # The wire algorithms call these; the defaults compose the primitives above through the
    # layout's fp32 staging buffer. Fused backends override them (one launch each).
    def encode(self, flat: torch.Tensor, layout, residual: Optional[torch.Tensor] = None,
               generator: Optional[torch.Generator] = None) -> None:
        """Quantize the bucket ``flat`` into the layout's packed ``send`` buffer (chunk d for rank
        d). With ``residual`` (padded fp32): quantize ``flat + residual`` and store the new
        quantization error in ``residual`` (only where it is finite: :func:`keep_finite_`)."""
        L, C = layout, layout.chunk_numel
        x = L.gather_from(flat)
        if residual is not None:
            x.add_(residual)
        self.quantize(x, L.groups, L.payload(L.send, C), L.scales(L.send, C), work=L.work,
                      block_amax=L.block_amax, group_amax=L.group_amax, group_scale=L.group_scale,
                      block_scale=L.block_scale, generator=generator)
        if residual is not None:
            self.dequantize(L.payload(L.send, C), L.scales(L.send, C), L.groups, L.work, L.block_scale)
            keep_finite_(residual, torch.sub(x, L.work, out=L.work))

    def reduce_shard(self, layout, residual: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None) -> None:
        """two_shot's middle step on the owner: dequantize and sum the W received chunks (``recv``)
        in fp32 in rank order, divide by W, requantize into ``gather_in``. With ``residual``: add W
        times the requantization error to this rank's residual for its own chunk (where that comes
        out non-finite, the residual keeps its value: :func:`keep_finite_`)."""
        L, W, C = layout, layout.world_size, layout.chunk_numel
        shard = self.dequantize_sum(L.payload(L.recv, C), L.scales(L.recv, C), L.own_groups_all_sources,
                                    L.shard, L.work, L.block_scale)
        shard.div_(W)
        self.quantize(shard, L.own_groups, L.payload(L.gather_in, C)[None], L.scales(L.gather_in, C)[None],
                      work=L.work, block_amax=L.block_amax, group_amax=L.group_amax,
                      group_scale=L.group_scale, block_scale=L.block_scale, generator=generator)
        if residual is not None:
            own = residual[L.rank * C:(L.rank + 1) * C]
            self.dequantize(L.payload(L.gather_in, C)[None], L.scales(L.gather_in, C)[None], L.own_groups,
                            L.work, L.block_scale)
            err = shard.sub_(L.work[:C])
            keep_finite_(own, torch.add(own, err, alpha=W, out=err))

    def decode(self, layout, flat: torch.Tensor) -> torch.Tensor:
        """Dequantize the gathered shards (``gather_out``) into the bucket ``flat`` in its dtype;
        returns ``flat``."""
        L, C = layout, layout.chunk_numel
        self.dequantize(L.payload(L.gather_out, C), L.scales(L.gather_out, C), L.groups, L.work, L.block_scale)
        return L.scatter_to(L.work, flat)

    # ------------------------------------------------------------------ an FP8 sum's stages (nccl_fp8)
    # The defaults compose the primitives through the layout's fp32 staging and work buffers; the
    # Triton codec fuses them for block scaling (reading and writing the unpadded bucket directly).
    def shared_amax(self, flat: torch.Tensor, layout, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the amax of every scale group of ``flat`` (plus ``residual``) into
        ``layout.group_amax`` (NaN reported as +Inf); returns it. The sum's first stage: the caller
        MAX-all-reduces the result, then calls :meth:`encode_shared` with the same ``residual``."""
        L = layout
        x = L.gather_from(flat)
        if residual is not None:
            x.add_(residual)
        return self.group_amax(x, L.groups, L.work, L.block_amax, L.group_amax)

    def encode_shared(self, flat: torch.Tensor, layout, scale_inv: torch.Tensor, *, pre_scale: float,
                      residual: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None) -> None:
        """Quantize ``flat`` (plus ``residual``) into ``layout.fp8_wire`` with scales from the shared
        ``layout.group_amax`` times ``pre_scale``, scale_inv into ``scale_inv`` ([W, groups per chunk]);
        with ``residual``, store this rank's new quantization error in it (where finite). Must follow
        :meth:`shared_amax` (the defaults reuse the staging buffer it filled)."""
        L = layout
        x = L.staging
        self.quantize_with_amax(x, L.groups, L.group_amax, L.fp8_wire, scale_inv, pre_scale=pre_scale, work=L.work,
                                group_scale=L.group_scale, block_scale=L.block_scale, generator=generator)
        if residual is not None:
            self.dequantize(L.fp8_wire, scale_inv, L.groups, L.work, L.block_scale)
            keep_finite_(residual, torch.sub(x, L.work, out=L.work))

    def decode_mean(self, layout, scale_inv: torch.Tensor, flat: torch.Tensor, saturated: torch.Tensor) -> torch.Tensor:
        """The sum's last stage: ``flat`` = the summed ``layout.fp8_wire`` times ``scale_inv``, divided
        by W (in fp32, then in ``flat``'s dtype); ``saturated`` (device int64 scalar) = the count of
        :func:`count_saturated`. Returns ``flat``."""
        L = layout
        self.dequantize(L.fp8_wire, scale_inv, L.groups, L.work, L.block_scale)
        count_saturated(L.fp8_wire, L.work, self.fmt, out=saturated)
        L.work.div_(L.world_size)
        return L.scatter_to(L.work, flat)

    @abc.abstractmethod
    def dequantize_sum(self, payload: torch.Tensor, scale_inv: torch.Tensor, groups: ScaleGroups,
                       out: torch.Tensor, work: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
        """Sum the ``groups.rows`` dequantized rows into ``out`` (``chunk_numel`` fp32), adding in
        row order 0, 1, ..., W-1 in fp32; returns ``out``."""
