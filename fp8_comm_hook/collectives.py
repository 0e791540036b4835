"""Every wire algorithm, and the only module that issues collectives on gradients.

All-reduces (the mean over ranks left in the flat tensor): :func:`two_shot`, :func:`nccl_fp8`,
:func:`plain_all_reduce` and :func:`cast_all_reduce` (the bf16 baseline). Reduce-scatters (this
rank's shard of the sum or mean written into ``out``): :func:`fp8_reduce_scatter` (two_shot's first
half: both share :func:`_scatter_reduce`), :func:`nccl_fp8_reduce_scatter` and
:func:`plain_reduce_scatter`. Each FP8 algorithm takes a bucket's flat gradient, its
:class:`~fp8_comm_hook.layout.BucketLayout`, a codec and a process group. Checks that need a
collective (:func:`check_configs_match`, :func:`bf16_all_reduce_works`) live here too.

With ``async_op=True`` a function returns ``(work, finish)``: every collective has been issued from
the caller's thread (gloo deadlocks when a collective is issued from a Future callback), ``work`` is
the last collective's handle, and ``finish()`` runs the local tail (dequantize, copy back) and returns
the flat tensor. With ``async_op=False`` it waits and returns the flat tensor.
"""
import math
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .codec.base import count_saturated, keep_finite_
from .layout import BucketLayout
from .stats import (CommStats, fp8_reduce_scatter_bytes, fp8_sum_bytes, ring_allreduce_bytes,
                    ring_reduce_scatter_bytes, two_shot_bytes)

__all__ = ["two_shot", "nccl_fp8", "plain_all_reduce", "cast_all_reduce", "fp8_reduce_scatter",
           "nccl_fp8_reduce_scatter", "plain_reduce_scatter", "all_gather_into", "reduce_scatter_into",
           "check_nccl_fp8_supported", "check_configs_match", "bf16_all_reduce_works", "encode_shared_scales",
           "count_saturated", "next_pre_scale", "adapt_pre_scale", "auto_pre_scale_step", "new_side_group",
           "time_all_reduce", "all_reduce_max"]

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


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Device bool: does the uncompressed mean ``t`` hold an Inf or NaN? One pass (an fp32 sum, which
    an Inf or NaN anywhere makes non-finite) instead of ``isfinite`` + ``any`` (30x the time on one
    CPU core for a 4M-element bucket). A finite bucket whose sum leaves the fp32 range (|sum| > 3.4e38)
    counts as non-finite too. bf16 is summed in its own dtype (the same exponent range as fp32; on
    one CPU core 35x faster than summing it into fp32: 0.7 ms against 24.6 ms for 12.6M values),
    fp16 into fp32 (its own range ends at 65504)."""
    return ~torch.isfinite(t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum())


def _scatter_reduce(flat: torch.Tensor, layout: BucketLayout, codec, group, residual: Optional[torch.Tensor],
                    generator: Optional[torch.Generator]) -> None:
    """The first half of two_shot and the whole FP8 reduce-scatter: quantize each destination chunk
    of ``flat`` (plus ``residual``) with its own scales into ``layout.send``, then one
    ``all_to_all_single`` of the packed bytes; afterwards ``layout.recv`` row r holds rank r's
    contribution to this rank's shard."""
    codec.encode(flat, layout, residual, generator)
    _all_to_all_rows(layout, group)


#: On gloo the FP8 exchanges go as point-to-point messages of at most this many bytes (gloo's
#: send/recv take host memory only: CUDA buckets are staged through pinned host mirrors of the
#: layout's packed buffers, as gloo's own CUDA collectives stage them). Measured over
#: a 0.2 Gbit/s shaped link between two ranks: one all-to-all of 2 x 2.2 MB took 88 ms in some runs and
#: 171-176 ms (twice its transfer) in others, an all-gather of 2.2 MB 87-148 ms; sent as 16 pieces the
#: same bytes took 90.5-94 ms every time. gloo's own ring all-reduce sends pieces too.
GLOO_PIECE_BYTES = 1 << 17
#: ... and a row goes in at most this many pieces (larger pieces for larger rows): every piece is a
#: gloo send/recv pair issued from Python (tens of us of host time each), and 128 KB pieces of a
#: 46M-parameter model's 11.9 MB rows (~90 per row) made FP8 no faster than the bf16 hook over a
#: 10 Gbit/s link with 4 ranks sharing an H200 (150.8 against 156.5 ms a step).
GLOO_MAX_PIECES = 16


def piece_bytes(row_bytes: int) -> int:
    """The piece size of a gloo exchange of ``row_bytes``-byte rows: :data:`GLOO_PIECE_BYTES`, or
    the row in :data:`GLOO_MAX_PIECES` pieces where that is larger (rounded up to 4 KB)."""
    per = -(-row_bytes // GLOO_MAX_PIECES)
    return max(GLOO_PIECE_BYTES, -(-per // 4096) * 4096)


def _exchange_rows(recv: torch.Tensor, send_row, group) -> None:
    """gloo: row r of ``recv`` (uint8 [W, n]) from rank r, ``send_row(dst)`` (uint8 [n]) to every
    other rank ``dst``, in pieces of :func:`piece_bytes`, all posted at once, one tag per piece;
    this rank's own row is copied. Returns when every piece has arrived.

    Tried and dropped: W - 1 rounds (round i to rank + i, from rank - i, the next posted when one
    is complete), so that every link carries one flow at a time as in a ring. Over 4 CPU nodes on
    shaped 1 Gbit/s links the exchange alone moved 0.85-0.88 Gbit/s out of each node against
    0.74-0.77 all at once, but the DDP step of a 46M MLP over 4 nodes at 10 Gbit/s (CUDA ranks
    sharing an H100) took 149-152 ms against 117-119 ms.

    The pieces go straight to the process group's own send/recv (group ranks, no ``P2POp`` and no
    ``batch_isend_irecv``): the Python wrappers cost more than the C++ call (96 pieces of a 4-rank
    exchange, one core per rank: ~1.2 ms issued through ``batch_isend_irecv``, ~0.8 ms directly)."""
    pg = dist.group.WORLD if group is None else group
    W, rank = pg.size(), pg.rank()
    n = recv.shape[1]
    piece = piece_bytes(n)
    works = []
    for i in range(1, W):
        dst, src = (rank + i) % W, (rank - i) % W
        out, into = send_row(dst), recv[src]
        for tag, a in enumerate(range(0, n, piece)):
            works.append(pg.send([out[a:a + piece]], dst, tag))
            works.append(pg.recv([into[a:a + piece]], src, tag))
    recv[rank].copy_(send_row(rank))
    for w in works:
        w.wait()


def _in_pieces(group) -> bool:
    """Whether exchanges on ``group`` go as point-to-point pieces: on gloo (CUDA buffers staged
    through pinned host memory, see :func:`_exchange_layout_rows`)."""
    return dist.get_backend(group) == "gloo"


def _exchange_layout_rows(layout: BucketLayout, out_name: str, in_name: str, row_for, group) -> None:
    """gloo: :func:`_exchange_rows` between the layout's packed buffers ``out_name`` (received rows)
    and ``in_name`` (``row_for(buffer, dst)`` is the row for rank ``dst``). CUDA buffers go through
    the layout's pinned host mirrors: a blocking copy out (after the stream's pending work, the
    encode), the pieces, a copy back."""
    out, inp = getattr(layout, out_name), getattr(layout, in_name)
    if out.is_cuda:
        ho, hi = layout.host_mirror(out_name), layout.host_mirror(in_name)
        hi.copy_(inp)
        _exchange_rows(ho, lambda dst: row_for(hi, dst), group)
        out.copy_(ho)
    else:
        _exchange_rows(out, lambda dst: row_for(inp, dst), group)


def _all_to_all_rows(layout: BucketLayout, group) -> None:
    """``layout.recv[r]`` = rank r's ``send`` row for this rank: one ``all_to_all_single``, or on
    gloo pieces (:func:`_exchange_layout_rows`). Returns when the exchange is complete."""
    if _in_pieces(group):
        _exchange_layout_rows(layout, "recv", "send", lambda send, dst: send[dst], group)
    else:
        dist.all_to_all_single(layout.recv, layout.send, group=group, async_op=True).wait()


def _all_gather_rows(layout: BucketLayout, group):
    """``layout.gather_out[r]`` = rank r's ``gather_in`` (uint8): an async all-gather (returns its
    work), or on gloo pieces (:func:`_exchange_layout_rows`; complete on return, returns a
    completed work)."""
    if not _in_pieces(group):
        return all_gather_into(layout.gather_out.view(-1), layout.gather_in, group=group, async_op=True)
    _exchange_layout_rows(layout, "gather_out", "gather_in", lambda inp, dst: inp, group)
    fut = torch.futures.Future()
    fut.set_result([layout.gather_out])
    return torch._C._distributed_c10d._create_work_from_future(fut)


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
    _scatter_reduce(flat, L, codec, group, residual, generator)
    codec.reduce_shard(L, residual, generator)
    work = _all_gather_rows(L, group)
    if stats is not None:
        stats.add("bytes_sent", two_shot_bytes(L.chunk_bytes, W))

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
    ps = layout.auto_pre_scale
    if ps is None:
        return 1.0 / math.sqrt(world_size)
    sat = layout.last_saturation()
    return next_pre_scale(ps, sat or 0, layout.padded_numel, world_size)


def auto_pre_scale_step(layout: BucketLayout) -> float:
    """Adapt ``layout``'s automatic pre_scale for this step (:func:`adapt_pre_scale`), record it on
    the layout and return it. Called once per FP8 sum, before it is encoded."""
    return layout.set_auto_pre_scale(adapt_pre_scale(layout, layout.world_size))


def _publish_saturation(layout: BucketLayout) -> None:
    # Inside a CUDA graph capture nothing is copied to the host: the replay's caller publishes.
    if layout.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    layout.publish_saturation()


def encode_shared_scales(flat: torch.Tensor, layout: BucketLayout, codec, group=None, *,
                         pre_scale: Optional[float] = None, residual: Optional[torch.Tensor] = None,
                         generator: Optional[torch.Generator] = None, scatter: bool = False) -> torch.Tensor:
    """The first half of an FP8 sum (``nccl_fp8`` and its reduce-scatter form): per-group amax of the
    whole padded bucket, one MAX all-reduce of the amax vector (NaN already reported as +Inf, so it
    survives), then quantize with the shared scales times ``pre_scale`` (None: automatic, see
    :func:`adapt_pre_scale`) into ``layout.fp8_wire`` ([W, chunk] uint8). With ``residual``, it is
    added first and replaced by this rank's quantization error. ``scatter``: the sum will be a
    reduce-scatter (its output shard is allocated too). Returns the shared scale_inv
    ([W, groups_per_chunk] fp32, pre-scale included)."""
    L, W = layout, layout.world_size
    ps = auto_pre_scale_step(L) if pre_scale is None else float(pre_scale)
    codec.shared_amax(flat, L, residual)
    dist.all_reduce(L.group_amax, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
    L.ensure_fp8_sum(scatter)
    sinv = L.fp8_scale_inv.view(W, -1)
    codec.encode_shared(flat, L, sinv, pre_scale=ps, residual=residual, generator=generator)
    return sinv


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
        stats.add("bytes_sent", fp8_sum_bytes(L.padded_numel, L.groups.num_groups, W))

    def finish() -> torch.Tensor:
        sat = L.saturation_buffer()
        codec.decode_mean(L, sinv, flat, sat)
        _publish_saturation(L)
        if stats is not None:
            stats.add_device("saturated_values", sat)
        _track_nonfinite(stats, sinv)
        return flat

    return _finish(work, finish, async_op)


def plain_all_reduce(flat: torch.Tensor, group=None, *, stats: Optional[CommStats] = None,
                     async_op: bool = False):
    """Uncompressed mean: SUM all-reduce in the tensor's own dtype, then divide by W."""
    W = dist.get_world_size(group)
    work = dist.all_reduce(flat, group=group, async_op=True)

    def finish() -> torch.Tensor:
        flat.div_(W)
        if stats is not None:
            stats.add_device("nonfinite_buckets", _nonfinite(flat))
        return flat

    if stats is not None:
        stats.add("bytes_sent", ring_allreduce_bytes(flat.numel() * flat.element_size(), W))
    return _finish(work, finish, async_op)


def cast_all_reduce(flat: torch.Tensor, group=None, *, wire_dtype: torch.dtype = torch.bfloat16,
                    sum_in_wire_dtype: bool = True, stats: Optional[CommStats] = None, async_op: bool = False,
                    wire: Optional[torch.Tensor] = None):
    """The cast baseline (torch's ``_compress_hook`` recipe): cast ``flat`` to ``wire_dtype``, divide
    by W, SUM all-reduce, cast back into ``flat``. With ``sum_in_wire_dtype=False`` (for backends
    that cannot sum ``wire_dtype``) the cast values are summed in ``flat``'s dtype and the mean is
    rounded to ``wire_dtype`` again: the wire dtype's numerics with ``flat``'s bytes on the wire.
    ``stats``: the bytes sent and a non-finite mean are counted (``algorithm="auto"``'s bf16 buckets).
    ``wire``: a ``wire_dtype`` buffer of ``flat``'s size to cast into instead of a new tensor (the
    same values; on the CPU a new 25 MB tensor costs more in page faults than the cast itself).
    Returns as the other algorithms do (``(work, finish)`` when ``async_op``)."""
    W = dist.get_world_size(group)
    if wire is not None:
        if wire.dtype != wire_dtype or wire.shape != flat.shape:
            raise ValueError(f"wire must be a {wire_dtype} tensor of shape {tuple(flat.shape)}, got {wire.dtype} "
                             f"{tuple(wire.shape)}")
        sent = wire.copy_(flat).div_(W)
    else:
        sent = flat.to(wire_dtype).div_(W)
    if not sum_in_wire_dtype:
        sent = sent.to(flat.dtype)
    work = dist.all_reduce(sent, group=group, async_op=True)
    if stats is not None:
        stats.add("bytes_sent", ring_allreduce_bytes(sent.numel() * sent.element_size(), W))

    def finish() -> torch.Tensor:
        if stats is not None:   # on the wire dtype's sum: half the bytes of the mean's
            stats.add_device("nonfinite_buckets", _nonfinite(sent))
        flat.copy_(sent if sum_in_wire_dtype else sent.to(wire_dtype))
        return flat

    return _finish(work, finish, async_op)


def bf16_all_reduce_works(group, device: torch.device) -> bool:
    """Whether ``group`` can SUM-all-reduce bf16 tensors on ``device`` (a one-element probe that
    every rank runs; a backend without bf16 rejects the dtype locally on every rank alike)."""
    t = torch.ones(1, dtype=torch.bfloat16, device=device)
    try:
        dist.all_reduce(t, group=group)
    except (RuntimeError, ValueError, TypeError):
        return False
    return float(t.item()) == float(dist.get_world_size(group))


# ---------------------------------------------------------------------------------- reduce-scatters
def fp8_reduce_scatter(flat: torch.Tensor, out: torch.Tensor, layout: BucketLayout, codec, group=None, *,
                       average: bool = True, stats: Optional[CommStats] = None,
                       residual: Optional[torch.Tensor] = None,
                       generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Reduce-scatter ``flat`` (W equal chunks) into ``out`` (this rank's chunk) through FP8: the first
    half of :func:`two_shot` (:func:`_scatter_reduce`), then the owner dequantizes and sums the W
    chunks in fp32 in rank order and divides by W when ``average`` (else leaves the sum). ``layout``
    must have one segment per chunk (padded chunk r is exactly shard r). ``residual``: error
    feedback, as in ``two_shot``. Returns ``out``."""
    L, W, C = layout, layout.world_size, layout.chunk_numel
    _scatter_reduce(flat, L, codec, group, residual, generator)
    shard = codec.dequantize_sum(L.payload(L.recv, C), L.scales(L.recv, C), L.own_groups_all_sources,
                                 L.shard, L.work, L.block_scale)
    if average:
        shard.div_(W)
    if stats is not None:
        stats.add("bytes_sent", fp8_reduce_scatter_bytes(L.chunk_bytes, W))
        _track_nonfinite(stats, L.scales(L.recv, C))
    out.copy_(shard[:out.numel()])
    return out


def nccl_fp8_reduce_scatter(flat: torch.Tensor, out: torch.Tensor, layout: BucketLayout, codec, group=None, *,
                            average: bool = True, pre_scale: Optional[float] = None,
                            stats: Optional[CommStats] = None, residual: Optional[torch.Tensor] = None,
                            generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Reduce-scatter through NCCL's FP8 SUM (NCCL on sm90+): :func:`encode_shared_scales` (shared
    scales times ``pre_scale``, None: automatic as in :func:`nccl_fp8`), FP8 ``reduce_scatter`` in
    ``torch.float8_*``, dequantize the own chunk with the shared scale_inv (divided by W when
    ``average``). Returns ``out``."""
    L, W, C = layout, layout.world_size, layout.chunk_numel
    fmt = codec.fmt
    sinv = encode_shared_scales(flat, L, codec, group, pre_scale=pre_scale, residual=residual,
                                generator=generator, scatter=True)
    reduce_scatter_into(L.fp8_out.view(fmt.dtype), L.fp8_wire.view(-1).view(fmt.dtype),
                        op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
    own_sinv = sinv[L.rank][None]
    codec.dequantize(L.fp8_out[None], own_sinv, L.own_groups, L.work, L.block_scale)
    shard = L.work[:C]
    sat = count_saturated(L.fp8_out, shard, fmt, out=L.saturation_buffer())
    _publish_saturation(L)
    if average:
        shard.div_(W)
    if stats is not None:
        stats.add("bytes_sent", fp8_sum_bytes(L.padded_numel, L.groups.num_groups, W, scatter=True))
        stats.add_device("saturated_values", sat)
        _track_nonfinite(stats, own_sinv)
    out.copy_(shard[:out.numel()])
    return out


def plain_reduce_scatter(flat: torch.Tensor, out: torch.Tensor, group=None, *, average: bool = True,
                         stats: Optional[CommStats] = None) -> torch.Tensor:
    """Uncompressed reduce-scatter in the tensor's own dtype (SUM, divided by W when ``average``);
    returns ``out``."""
    W = dist.get_world_size(group)
    reduce_scatter_into(out, flat, op=dist.ReduceOp.SUM, group=group)
    if average:
        out.div_(W)
    if stats is not None:
        stats.add("bytes_sent", ring_reduce_scatter_bytes(flat.numel() * flat.element_size(), W))
        stats.add_device("nonfinite_buckets", _nonfinite(out))
    return out


def check_configs_match(config, group=None) -> None:
    """Raise ``ValueError`` if any rank of ``group`` holds a different config (an
    :class:`~fp8_comm_hook.config.FP8CommConfig`; mismatched configs would otherwise exchange
    garbage: every rank must derive the same packed sizes)."""
    if dist.get_world_size(group) == 1:
        return
    mine = config.to_dict()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for r, other in enumerate(gathered):
        if other != mine:
            diff = sorted(k for k in mine if mine[k] != other.get(k))
            raise ValueError(f"FP8CommConfig differs between ranks: rank {dist.get_rank(group)} and rank {r} "
                             f"disagree on {diff} ({ {k: mine[k] for k in diff} } vs { {k: other.get(k) for k in diff} })")


def new_side_group(group=None):
    """A new process group with the ranks and backend of ``group`` (default: the world group), for
    collectives issued from another thread (see :mod:`fp8_comm_hook.worker`), or None when ``group``
    does not span every rank: ``dist.new_group`` is a call every rank of the world must make, and a
    rank outside ``group`` never gets here. Call it on every rank of ``group``."""
    if dist.get_world_size(group) != dist.get_world_size():
        return None
    return dist.new_group(ranks=dist.get_process_group_ranks(group if group is not None else dist.group.WORLD),
                          backend=dist.get_backend(group))


# ---------------------------------------------------------------------------------- measuring (auto)
def time_all_reduce(numel: int, group=None, device: torch.device = torch.device("cpu"), repeats: int = 3,
                    dtype: torch.dtype = torch.float32) -> float:
    """Seconds of a SUM all-reduce of ``numel`` elements of ``dtype`` on ``device`` over ``group`` (for
    :mod:`fp8_comm_hook.autotune`): the fastest of ``repeats`` after one untimed warm-up (the fastest,
    not the median: a rank descheduled once on a busy host must not set the figure); each timed call
    follows a one-element all-reduce so that the ranks start it together. Every rank of ``group``
    must call it."""
    device = torch.device(device)
    x = torch.zeros(numel, device=device, dtype=dtype)
    start = torch.zeros(1, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.all_reduce(x, group=group)
    times = []
    for _ in range(repeats):
        dist.all_reduce(start, group=group)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def all_reduce_max(values: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise MAX of ``values`` over ``group``, in place; returns ``values``. Every rank of
    ``group`` must call it."""
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values
