"""The wire algorithms. Each takes a bucket's flat gradient, its :class:`BucketLayout`, a codec and
a process group, and leaves the mean over ranks in the flat tensor.

With ``async_op=True`` a function returns ``(work, finish)``: every collective has been issued from
the caller's thread (gloo deadlocks when a collective is issued from a Future callback), ``work`` is
the last collective's handle, and ``finish()`` runs the local tail (dequantize, copy back) and returns
the flat tensor. With ``async_op=False`` it waits and returns the flat tensor.
"""
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .codec.base import keep_finite_
from .layout import BucketLayout
from .stats import CommStats, ring_allreduce_bytes

__all__ = ["two_shot", "nccl_fp8", "plain_all_reduce", "all_gather_into", "reduce_scatter_into",
           "check_nccl_fp8_supported", "encode_shared_scales", "count_saturated"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``all_gather_single`` on torch >= 2.13, ``all_gather_into_tensor`` before."""
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``reduce_scatter_single`` on torch >= 2.13, ``reduce_scatter_tensor`` before."""
    return _reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op)


def _finish(work, finish: Callable[[], torch.Tensor], async_op: bool):
    if async_op:
        return work, finish
    if work is not None:
        work.wait()
    return finish()


def _track_nonfinite(stats: Optional[CommStats], scale_inv: torch.Tensor) -> None:
    if stats is not None:
        stats.add_device("nonfinite_buckets", (~torch.isfinite(scale_inv)).any())


def two_shot(flat: torch.Tensor, layout: BucketLayout, codec, group=None, *, stats: Optional[CommStats] = None,
             residual: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
             async_op: bool = False):
    """Mean of ``flat`` over ``group`` through FP8: quantize each destination chunk with its own
    scales, one ``all_to_all_single`` of packed bytes, fp32 dequantize-sum and mean on the owner,
    requantize the owned shard, one all-gather of packed shards, dequantize everywhere.

    Every rank dequantizes the same gathered bytes, so the result is bit-identical across ranks.
    ``residual`` (padded fp32, error feedback) is added to the input and replaced by this rank's
    quantization error; the owner folds W times its requantization error into it.
    """
    L, W, C = layout, layout.world_size, layout.chunk_numel
    codec.encode(flat, L, residual, generator)
    dist.all_to_all_single(L.recv, L.send, group=group, async_op=True).wait()
    codec.reduce_shard(L, residual, generator)
    work = all_gather_into(L.gather_out.view(-1), L.gather_in, group=group, async_op=True)
    if stats is not None:
        stats.add("bytes_sent", 2 * (W - 1) * L.chunk_bytes)

    def finish() -> torch.Tensor:
        _track_nonfinite(stats, L.scales(L.gather_out, C))
        return codec.decode(L, flat)

    return _finish(work, finish, async_op)


def check_nccl_fp8_supported(group, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``group`` is an NCCL group and ``device`` an sm90+ GPU."""
    backend = dist.get_backend(group)
    device = torch.device(device)
    ok = backend == "nccl" and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    if not ok:
        raise ValueError("algorithm='nccl_fp8' needs NCCL on an sm90+ GPU (an FP8 SUM all-reduce in "
                         f"torch.float8_*); this group uses {backend!r} on {device}. Use algorithm='two_shot'.")


SATURATION_LIMIT = 1e-5   # saturated fraction above which the automatic pre_scale halves
PRE_SCALE_GROWTH = 1.05   # growth per step otherwise, up to 1 / sqrt(W) ... 1


def next_pre_scale(current: float, saturated: int, numel: int, world_size: int) -> float:
    """The automatic pre_scale rule: halve when more than 1e-5 of the summed values saturated,
    else grow by 5% per step, never above 1 nor below 1/W^2. Every rank sees the same sum, so every
    rank makes the same choice; scale_inv carries the pre_scale, so the mean stays exact."""
    if numel and saturated / numel > SATURATION_LIMIT:
        return max(current / 2, 1.0 / world_size ** 2)
    return min(current * PRE_SCALE_GROWTH, 1.0)


def adapt_pre_scale(layout: BucketLayout, world_size: int) -> float:
    """This step's automatic pre_scale for ``layout``: 1/sqrt(W) at first, then
    :func:`next_pre_scale` of the previous step's saturation count (read one step late, when the
    previous sum has long finished)."""
    ps = getattr(layout, "auto_pre_scale", None)
    if ps is None:
        return 1.0 / math.sqrt(world_size)
    sat = getattr(layout, "saturated_last", None)
    return next_pre_scale(ps, int(sat.item()) if sat is not None else 0, layout.padded_numel, world_size)


def encode_shared_scales(flat: torch.Tensor, layout: BucketLayout, codec, group=None, *,
                         pre_scale: Optional[float] = None, residual: Optional[torch.Tensor] = None,
                         generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The first half of an FP8 sum (``nccl_fp8`` and its reduce-scatter form): per-group amax of the
    whole padded bucket, one MAX all-reduce of the amax vector (NaN already reported as +Inf, so it
    survives), then quantize with the shared scales times ``pre_scale`` (None: automatic, see
    :func:`adapt_pre_scale`) into ``layout.fp8_wire`` ([W, chunk] uint8). With ``residual``, it is
    added first and replaced by this rank's quantization error. Returns the shared scale_inv
    ([W, groups_per_chunk] fp32, pre-scale included)."""
    L, W, C = layout, layout.world_size, layout.chunk_numel
    if pre_scale is None:
        ps = L.auto_pre_scale = adapt_pre_scale(L, W)
    else:
        ps = float(pre_scale)
    x = L.gather_from(flat)
    if residual is not None:
        x.add_(residual)
    codec.group_amax(x, L.groups, L.work, L.block_amax, L.group_amax)
    dist.all_reduce(L.group_amax, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
    if L.fp8_wire is None:
        L.fp8_wire = torch.empty(W, C, dtype=torch.uint8, device=L.device)
    if getattr(L, "fp8_scale_inv", None) is None:
        L.fp8_scale_inv = torch.empty(L.groups.num_groups, dtype=torch.float32, device=L.device)
    sinv = L.fp8_scale_inv.view(W, -1)
    codec.quantize_with_amax(x, L.groups, L.group_amax, L.fp8_wire, sinv, pre_scale=ps, work=L.work,
                             group_scale=L.group_scale, block_scale=L.block_scale, generator=generator)
    if residual is not None:
        codec.dequantize(L.fp8_wire, sinv, L.groups, L.work, L.block_scale)
        keep_finite_(residual, torch.sub(x, L.work, out=L.work))
    return sinv


def count_saturated(wire: torch.Tensor, dequantized: torch.Tensor, fmt) -> torch.Tensor:
    """How many values of an FP8 sum (``wire``, uint8 bytes of ``fmt``) sit at +-fmax, counting only
    scale groups with a finite scale (where ``dequantized``, the same values times scale_inv, is not
    NaN): a group that held an Inf or NaN is reported as non-finite, not as saturation, so it does
    not halve the automatic pre_scale. Returns a device scalar (no synchronisation)."""
    q = wire.reshape(-1).view(fmt.dtype).float()
    return ((q.abs() >= fmt.fmax) & ~torch.isnan(dequantized[:q.numel()])).sum()


def nccl_fp8(flat: torch.Tensor, layout: BucketLayout, codec, group=None, *, pre_scale: Optional[float] = None,
             stats: Optional[CommStats] = None, residual: Optional[torch.Tensor] = None,
             generator: Optional[torch.Generator] = None, async_op: bool = False):
    """Mean of ``flat`` through NCCL's FP8 SUM all-reduce (MS-AMP style): per-group amax, one MAX
    all-reduce of the amax vector, shared scales times ``pre_scale``, FP8 sum, dequantize with
    scale_inv / W. Values at +-fmax after the sum are counted as saturated (in finite scale groups:
    :func:`count_saturated`). ``pre_scale=None`` starts
    at 1/sqrt(W) and adapts per bucket (:func:`next_pre_scale`)."""
    L, W = layout, layout.world_size
    fmt = codec.fmt
    sinv = encode_shared_scales(flat, L, codec, group, pre_scale=pre_scale, residual=residual, generator=generator)
    work = dist.all_reduce(L.fp8_wire.view(fmt.dtype), op=dist.ReduceOp.SUM, group=group, async_op=True)
    if stats is not None:
        stats.add("bytes_sent", ring_allreduce_bytes(4 * L.groups.num_groups + L.padded_numel, W))

    def finish() -> torch.Tensor:
        codec.dequantize(L.fp8_wire, sinv, L.groups, L.work, L.block_scale)
        sat = count_saturated(L.fp8_wire, L.work, fmt)
        L.saturated_last = sat
        if stats is not None:
            stats.add_device("saturated_values", sat)
        L.work.div_(W)
        _track_nonfinite(stats, sinv)
        return L.scatter_to(L.work, flat)

    return _finish(work, finish, async_op)


def plain_all_reduce(flat: torch.Tensor, group=None, *, stats: Optional[CommStats] = None,
                     async_op: bool = False):
    """Uncompressed mean: SUM all-reduce in the tensor's own dtype, then divide by W."""
    W = dist.get_world_size(group)
    work = dist.all_reduce(flat, group=group, async_op=True)

    def finish() -> torch.Tensor:
        flat.div_(W)
        if stats is not None:
            stats.add_device("nonfinite_buckets", (~torch.isfinite(flat)).any())
        return flat

    if stats is not None:
        stats.add("bytes_sent", ring_allreduce_bytes(flat.numel() * flat.element_size(), W))
    return _finish(work, finish, async_op)
