"""Fused Triton kernels for the FP8 codec (GPU; the Triton interpreter runs them on CPU for tests).

Bytes match the torch reference codec exactly for round-to-nearest-even on finite inputs: every fp32
operation of the reference is done in the same order with IEEE rounding (precise division via
``tl.math.div_rn``, no FMA contraction: kernels launch with ``enable_fp_fusion=False``), values are
clamped to +-fmax before the cast, and the cast itself is RNE. For non-finite groups only
``scale_inv = NaN`` is normative (Triton's cast saturates where torch's gives NaN).

Launches per bucket for ``two_shot``:

* block scaling: encode 1, reduce_shard 1, decode 1;
* tensor / bucket scaling: encode 2 (block amax folded into the group amax with one atomic max per
  group run of a tile, then quantize), reduce_shard 2, decode 1.

The group amax of tensor/bucket scaling lives in an int64 buffer holding ``epoch << 32 | amax_bits``
(amax >= 0, so its fp32 bits order like the values). Every call uses a new epoch, so entries left by
earlier calls lose every max and the buffer never needs zeroing; an entry whose epoch is not the
current one belongs to a group with no blocks (amax 0, as in the reference).

Per layout, a segment table (source offset and valid length of every block of the padded buffer)
is derived once from ``layout.src_offsets``, ``layout.dst_offsets`` and ``layout.numels`` into the
codec's workspace for that layout (:class:`_Plan`, held by the codec and keyed weakly by the layout),
so encode reads the unpadded bucket and decode writes it back directly. The kernels themselves are in
:mod:`fp8_comm_hook.codec.triton_kernels`.
"""
import functools
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from ..geometry import ScaleGroups
from .base import Codec
from .triton_kernels import (_AMAX_EPOCH_GROUP, _AMAX_F32_BLOCK, _AMAX_F32_GROUP, _AMAX_MAX_BLOCKS, _AMAX_TILE,
                             _AMAX_TILE_BLOCK, _DIV_NONE,
                             _RECV_AMAX_LANES, _RECV_AMAX_TILE, _DIV_RECIPROCAL, _DIV_TRUE, _EPOCH_LIMIT,
                             _GROUPS_PER_PROGRAM, _INT32_SAFE, _INTERPRET, _QUANT_TILE, _RECV_LANES, _RECV_PAY_AL,
                             _RECV_UNROLL, _RES_ENCODE, _RES_FOLD, _RES_NONE, _SEGMENT_ENCODE_LANES,
                             _SEGMENT_LANES, _SEGMENT_TILE,
                             _SRC_CONTIG, _SRC_DENSE, _SRC_RECV, _SRC_SEGMENTS, _amax_finish_kernel, _amax_kernel,
                             _dequant_kernel, _quant_kernel)

__all__ = ["TritonCodec"]


# ---------------------------------------------------------------------------------------- host side
# Off until measured on a GPU: a bucket read through the segment table is encoded and decoded in one
# launch per alignment class of its blocks (TritonCodec._block_launches) instead of one launch.
SEGMENT_CLASSES = False


def _quant_tile(contig: Optional[int]) -> int:
    """Elements per program of a launch reading or writing the bucket: :data:`_SEGMENT_TILE` through
    the segment table (``contig`` None), else :data:`_QUANT_TILE`. Measured on an H100 (odd
    buckets, 64M-512M elements): encode 91-95% of copy with 2048 against 88-92% with 4096 (fp32),
    62-65% against 59-63% (bf16); decode within 2%."""
    return _SEGMENT_TILE if contig is None else _QUANT_TILE


def _blocks_per_program(block_size: int, tile: int, cap: Optional[int] = None) -> int:
    """Blocks per program for a tile of ``tile`` elements (a power of two)."""
    nb = max(1, tile // block_size)
    return min(nb, cap) if cap else nb


def _warps(nb: int, block_size: int) -> int:
    """Warps per program for a tile of ``nb`` blocks."""
    return 8 if nb * block_size >= 4096 else 4


def _encode_warps(nb: int, block_size: int, flat: torch.Tensor, contig: Optional[int]) -> int:
    """Warps of the one-pass encode: 4 for a contiguous bf16 bucket, whose 8-byte loads per lane
    left 8 warps waiting on too few bytes (measured: 0.85 against 0.65 of copy at 64M elements,
    0.94 against 0.69 at 512M); otherwise :func:`_warps`."""
    if contig is not None and flat.dtype == torch.bfloat16:
        return 4
    return _warps(nb, block_size)


def _src_al(contig: Optional[int]) -> int:
    """SRC_AL of a launch reading a contiguous bucket of ``contig`` elements (None: not contiguous):
    the largest of 16, 8, 4, 2 dividing it (1: none), so that the loads vectorise."""
    if not contig:
        return 1
    for a in (16, 8, 4, 2):
        if contig % a == 0:
            return a
    return 1


def _tile_args(block_size: int, bpc: int, nb: int, strides=(), unaligned: bool = False, lanes: int = 32,
               max_al: int = 4, encode: bool = False) -> dict:
    """Tile constants of a launch: LW lanes per block row (a warp reads LW consecutive elements of
    one block; ``lanes``, capped at the block size), ONE_WRAP when a tile crosses at most one
    packed-row boundary, and PAY_AL, the byte alignment promised for the payload row strides, at
    most ``max_al`` (1 when the source is read unaligned: then no access of the tile is widened, and
    the unaligned loads stay coalesced; LW is then :data:`_SEGMENT_LANES`, or
    :data:`_SEGMENT_ENCODE_LANES` for an ``encode``)."""
    al = 1
    if unaligned:
        lanes = _SEGMENT_ENCODE_LANES if encode else _SEGMENT_LANES
    else:
        for p in (16, 8, 4, 2):
            if p <= max_al and all(int(s) % p == 0 for s in strides):
                al = p
                break
    return dict(LW=min(block_size, lanes), PAY_AL=al, ONE_WRAP=bpc >= nb)


@functools.lru_cache(maxsize=None)
def _torch_div_mode(device_type: str) -> int:
    """How torch computes ``t.div_(W)`` (the reference's mean) on this device type: CUDA multiplies
    by the fp32 reciprocal of a CPU scalar divisor, the CPU divides. Probed once, so the fused mean
    rounds exactly like the reference on either."""
    dev = torch.device(device_type)
    gen = torch.Generator().manual_seed(1234)
    x = (torch.rand(4096, generator=gen) * 100 + 1).to(dev)
    ref = x.clone().div_(3)
    recip = x * torch.tensor(1.0 / 3.0, dtype=torch.float32, device=dev)
    true = x / torch.tensor(3.0, dtype=torch.float32, device=dev)
    if torch.equal(ref, recip) and not torch.equal(ref, true):
        return _DIV_RECIPROCAL
    return _DIV_TRUE


def _mix(*vals: int) -> int:
    """A 31-bit seed mixing integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in vals:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFF


def _seed_from(generator: Optional[torch.Generator], stage: int) -> int:
    """A kernel seed from ``generator`` without touching the device: the generator's seed (and, for
    a CUDA generator, its Philox offset, which is then advanced so that a second call without
    reseeding draws new numbers). ``None`` draws from torch's default CPU generator."""
    if generator is None:
        return _mix(int(torch.randint(0, 2 ** 62, (1,)).item()), stage)
    if generator.device.type == "cpu":
        return _mix(int(torch.randint(0, 2 ** 62, (1,), generator=generator).item()), stage)
    base, off = generator.initial_seed(), 0
    try:
        off = generator.get_offset()
        generator.set_offset(off + 4)
    except Exception:  # generators without a Philox offset: the seed alone
        off = 0
    return _mix(base, off, stage)


class _Plan:
    """The codec's workspace for one layout: what the fused stages derive once (segment table, group
    tables) and the amax buffers they reuse."""

    def __init__(self, layout):
        L = layout
        W, bs, C, bpc = L.world_size, L.block_size, L.chunk_numel, L.blocks_per_chunk
        nblocks = W * bpc
        big = max(L.padded_numel, L.src_numel, W * L.chunk_bytes) >= _INT32_SAFE
        idx_dtype = torch.int64 if big else torch.int32
        src = torch.zeros(nblocks, dtype=torch.int64)
        valid = torch.zeros(nblocks, dtype=torch.int32)
        for s, d, n in zip(L.src_offsets, L.dst_offsets, L.numels):
            if n == 0:
                continue
            first, nblk = d // bs, (n + bs - 1) // bs
            k = torch.arange(nblk, dtype=torch.int64) * bs
            src[first:first + nblk] = s + k
            valid[first:first + nblk] = (n - k).clamp_(max=bs).to(torch.int32)
        dev = L.device
        self.idx64 = big
        self._classes = {}
        self.src = src.to(idx_dtype).to(dev)
        self.valid = valid.to(dev)
        self.nblocks = nblocks
        self.grp = self.own_grp = self.own_grp_all = None
        if L.groups.block_group is not None:
            self.grp = L.groups.block_group.to(device=dev, dtype=torch.int32).contiguous()
            self.own_grp = L.own_groups.block_group.to(device=dev, dtype=torch.int32).contiguous()
            self.own_grp_all = L.own_groups_all_sources.block_group.to(device=dev, dtype=torch.int32).contiguous()
            self.gam_enc = torch.zeros(L.groups.num_groups, dtype=torch.int64, device=dev)
            self.gam_red = torch.zeros(L.own_groups.num_groups, dtype=torch.int64, device=dev)
        self._epochs = {"enc": 0, "red": 0}
        # One run from offset 0 in both buffers (no padding inside the bucket): plain loads/stores.
        runs = L.copy_runs
        self.contig = (runs[0][2] if len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == 0
                       else (0 if not runs else None))
        # The packed buffers are viewed as fp32 at each call (``L.send.view(torch.float32)``), not
        # cached here: a pooled layout (FSDP) rebinds them to other storage between calls.
        self.row_words = L.chunk_bytes // 4
        self.scale_word0 = C // 4

    def classes(self, esize: int, block_size: int):
        """(block order, [(alignment, start, count)]) for a bucket of ``esize``-byte elements read
        through the segment table: the blocks grouped by class, the largest first. A full block
        whose source offset is a multiple of a (2, 4, ... up to 16 bytes of elements) is in class
        a; every other block (a parameter's last, partial block, padding, an odd offset) in class 1."""
        c = self._classes.get(esize)
        if c is None:
            vec = max(1, 16 // esize)
            src = self.src.cpu()
            full = self.valid.cpu() == block_size
            al = torch.ones_like(src)
            a = 2
            while a <= vec:
                al = torch.where(full & (src % a == 0), torch.full_like(al, a), al)
                a *= 2
            order, classes, start = [], [], 0
            for a in sorted(set(al.tolist()), reverse=True):
                ids = torch.nonzero(al == a).flatten()
                order.append(ids)
                classes.append((int(a), start, ids.numel()))
                start += ids.numel()
            c = self._classes[esize] = (torch.cat(order).to(self.src.dtype).to(self.src.device), classes)
        return c

    def next_epoch(self, key: str) -> int:
        """The epoch for the next use of amax buffer ``key`` (rezeroing it once every 2^31 calls)."""
        e = self._epochs[key] + 1
        if e >= _EPOCH_LIMIT:
            (self.gam_enc if key == "enc" else self.gam_red).zero_()
            e = 1
        self._epochs[key] = e
        return e


class TritonCodec(Codec):
    """FP8 codec with fused Triton kernels (one launch per two_shot stage for block scaling, at most
    two for tensor/bucket scaling), writing the same bytes as :class:`TorchCodec` for RNE.

    ``stochastic_rounding=True`` rounds unbiasedly with Triton's Philox generator, seeded from the
    ``generator`` argument on the host (no device sync); deterministic for a given seed, but not the
    torch codec's random stream.
    """

    name = "triton"

    def __init__(self, fmt, stochastic_rounding: bool = False):
        super().__init__(fmt)
        self.stochastic_rounding = bool(stochastic_rounding)
        self._fp8 = tl.float8e4nv if fmt.name == "e4m3" else tl.float8e5
        self._min_exp = -6 if fmt.name == "e4m3" else -14
        self._bias = 7 if fmt.name == "e4m3" else 15
        # The hardware cast on GPUs; the exact software cast under the interpreter.
        self._soft_fp8 = _INTERPRET
        self._scratch = {}  # (device, num_groups) -> [int64 epoch buffer, epoch] for the primitives
        # One workspace per layout, dropped with the layout.
        self._plans: "weakref.WeakKeyDictionary[object, _Plan]" = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ plumbing
    def _consts(self):
        return dict(FP8=self._fp8, FMAX=float(self.fmt.fmax), MBITS=self.fmt.mantissa_bits, MIN_EXP=self._min_exp,
                    BIAS=self._bias, SOFT_FP8=self._soft_fp8)

    def _plan(self, layout) -> _Plan:
        """This codec's workspace for ``layout``, derived on first use."""
        plan = self._plans.get(layout)
        if plan is None:
            plan = self._plans[layout] = _Plan(layout)
        return plan

    def _seed(self, generator, stage: int) -> int:
        return _seed_from(generator, stage) if self.stochastic_rounding else 0

    @staticmethod
    def _launch(kernel, grid, device, *args, **kwargs):
        kwargs.setdefault("enable_fp_fusion", False)
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device.index):
                kernel[grid](*args, **kwargs)
        else:
            kernel[grid](*args, **kwargs)

    def _primitive_scratch(self, device, ngroups: int):
        key = (device, ngroups)
        entry = self._scratch.get(key)
        if entry is None:
            if len(self._scratch) > 64:
                self._scratch.clear()
            entry = self._scratch[key] = [torch.zeros(ngroups, dtype=torch.int64, device=device), 0]
        entry[1] += 1
        if entry[1] >= _EPOCH_LIMIT:
            entry[0].zero_()
            entry[1] = 1
        return entry[0], entry[1]

    @staticmethod
    def _rows_view(t: torch.Tensor, width: int):
        """(tensor, row stride in elements) of a [rows, width] (or flat) view with unit inner stride."""
        if t.dim() >= 2:
            if t.stride(-1) != 1 and t.size(-1) > 1:
                raise ValueError("packed buffer views need a unit inner stride")
            return t, t.stride(-2)
        return t, width

    @staticmethod
    def _big(*sizes) -> bool:
        return max(sizes) >= _INT32_SAFE

    # ------------------------------------------------------------------ Codec primitives
    def group_amax(self, x, groups: ScaleGroups, work, block_amax, out):
        """Group amax of a padded fp32 ``x`` (NaN as +Inf): one launch for block scaling, two for
        tensor/bucket scaling (block amax with per-run atomics, then the fp32 conversion)."""
        nblocks, bs = groups.num_blocks, groups.block_size
        nb = _blocks_per_program(bs, _AMAX_TILE, _AMAX_MAX_BLOCKS)
        dev, idx64 = x.device, self._big(groups.rows * groups.chunk_numel)
        common = dict(FP8=self._fp8, BS=bs, NB=nb, SOURCE=_SRC_DENSE, SRC_GROUPED=False, DIV_MODE=_DIV_NONE,
                      HAS_RES=False, STORE_X=False, STORE_BAMAX=True, IDX64=idx64, num_warps=_warps(nb, bs),
                      LW=min(bs, 32))
        grid = (triton.cdiv(nblocks, nb),)
        if groups.block_group is None:
            self._launch(_amax_kernel, grid, dev, x, x, x, x, 0, x, 0, x, 1, 1.0, 1.0, x, x, out, x, x, 0,
                         nblocks, groups.chunk_numel // bs, 1, ATOMIC=False, **common)
            return out
        gam, epoch = self._primitive_scratch(dev, groups.num_groups)
        grp = groups.block_group
        self._launch(_amax_kernel, grid, dev, x, x, x, x, 0, x, 0, x, 1, 1.0, 1.0, x, x, block_amax, grp, gam, epoch,
                     nblocks, groups.chunk_numel // bs, groups.groups_per_row, ATOMIC=True, **common)
        ng = groups.num_groups
        self._launch(_amax_finish_kernel, (triton.cdiv(ng, _GROUPS_PER_PROGRAM),), dev, gam, out, epoch, ng,
                     GB=_GROUPS_PER_PROGRAM)
        return out

    def quantize_with_amax(self, x, groups: ScaleGroups, amax, payload, scale_inv, *, pre_scale, work,
                           group_scale, block_scale, generator: Optional[torch.Generator] = None):
        """Quantize a padded fp32 ``x`` with scales from the given group ``amax`` (times
        ``pre_scale``), in one launch."""
        self._quantize_dense(x, groups, payload, scale_inv, amax=amax, pre_scale=pre_scale, generator=generator)

    def quantize(self, x, groups: ScaleGroups, payload, scale_inv, *, work, block_amax, group_amax, group_scale,
                 block_scale, generator: Optional[torch.Generator] = None):
        """Block scaling in one launch (amax, scale and cast fused); tensor/bucket scaling as amax
        then cast."""
        if groups.block_group is None:
            self._quantize_dense(x, groups, payload, scale_inv, amax=None, pre_scale=1.0, generator=generator)
            return
        super().quantize(x, groups, payload, scale_inv, work=work, block_amax=block_amax, group_amax=group_amax,
                         group_scale=group_scale, block_scale=block_scale, generator=generator)

    def _quantize_dense(self, x, groups: ScaleGroups, payload, scale_inv, *, amax, pre_scale, generator):
        rows, C, bs = groups.rows, groups.chunk_numel, groups.block_size
        nblocks, bpc, G, ng = groups.num_blocks, C // bs, groups.groups_per_row, groups.num_groups
        pay, pay_stride = self._rows_view(payload, C)
        sc, sc_stride = self._rows_view(scale_inv, G)
        if amax is None:
            mode, grp, am = _AMAX_TILE_BLOCK, x, x
        elif groups.block_group is None:
            mode, grp, am = _AMAX_F32_BLOCK, x, amax
        else:
            mode, grp, am = _AMAX_F32_GROUP, groups.block_group, amax
        nb = _blocks_per_program(bs, _QUANT_TILE)
        nprog = triton.cdiv(nblocks, nb)
        if mode == _AMAX_F32_GROUP:
            nprog = max(nprog, triton.cdiv(ng, _GROUPS_PER_PROGRAM))
        idx64 = self._big(rows * C, pay.numel() + rows * pay_stride)
        self._launch(_quant_kernel, (nprog,), x.device,
                     x, x, x, x, 0, x, 0, 1, 1.0, 1.0, grp, am, 0, x, 1.0, pay, pay_stride, sc, sc_stride,
                     nblocks, bpc, G, ng, float(pre_scale), self._seed(generator, 2),
                     BS=bs, NB=nb, GB=_GROUPS_PER_PROGRAM, SOURCE=_SRC_DENSE, AMAX_MODE=mode, RES_MODE=_RES_NONE,
                     SR=self.stochastic_rounding, DIV_MODE=_DIV_NONE, IDX64=idx64, num_warps=_warps(nb, bs),
                     **_tile_args(bs, bpc, nb, (pay_stride,)), **self._consts())

    def dequantize(self, payload, scale_inv, groups: ScaleGroups, out, block_scale):
        """``out = q * scale_inv`` per group into a padded fp32 buffer, in one launch."""
        rows, C, bs = groups.rows, groups.chunk_numel, groups.block_size
        nblocks, G = groups.num_blocks, groups.groups_per_row
        pay, pay_stride = self._rows_view(payload, C)
        sc, sc_stride = self._rows_view(scale_inv, G)
        grouped = groups.block_group is not None
        grp = groups.block_group if grouped else out
        nb = _blocks_per_program(bs, _QUANT_TILE)
        self._launch(_dequant_kernel, (triton.cdiv(nblocks, nb),), out.device,
                     pay, pay_stride, sc, sc_stride, grp, G, out, out, out, nblocks, C // bs, 0,
                     FP8=self._fp8, BS=bs, NB=nb, GROUPED=grouped, SEGMENTED=False,
                     IDX64=self._big(rows * C, rows * pay_stride), num_warps=_warps(nb, bs),
                     **_tile_args(bs, C // bs, nb, (pay_stride,)))
        return out

    def dequantize_sum(self, payload, scale_inv, groups: ScaleGroups, out, work, block_scale):
        """Sum of the dequantized rows in fp32, in row order (as the reference), in one launch."""
        rows, C, bs = groups.rows, groups.chunk_numel, groups.block_size
        bpc, G = C // bs, groups.groups_per_row
        pay, pay_stride = self._rows_view(payload, C)
        sc, sc_stride = self._rows_view(scale_inv, G)
        grouped = groups.block_group is not None
        sgrp = groups.block_group if grouped else out
        nb = _blocks_per_program(bs, _AMAX_TILE, _AMAX_MAX_BLOCKS)
        self._launch(_amax_kernel, (triton.cdiv(bpc, nb),), out.device,
                     out, out, out, pay, pay_stride, sc, sc_stride, sgrp, rows, 1.0, 1.0,
                     out, out, out, out, out, 0, bpc, bpc, G,
                     FP8=self._fp8, BS=bs, NB=nb, SOURCE=_SRC_RECV, SRC_GROUPED=grouped, DIV_MODE=_DIV_NONE,
                     HAS_RES=False, STORE_X=True, STORE_BAMAX=False, ATOMIC=False,
                     IDX64=self._big(rows * pay_stride), num_warps=_warps(nb, bs), UNROLL=min(_RECV_UNROLL, rows),
                     LW=min(bs, 32), PAY_AL=_tile_args(bs, bpc, nb, (pay_stride,))["PAY_AL"])
        return out

    # ------------------------------------------------------------------ two_shot's fused stages
    @staticmethod
    def _block_launches(P: "_Plan", flat: torch.Tensor, bs: int, bpc: int, nb: int, strides, lanes: int = 32,
                        encode: bool = False):
        """[(program count, launch arguments)] of a stage over every block of the bucket ``flat``: one
        launch, or, for a bucket read through the segment table with :data:`SEGMENT_CLASSES` on, one
        per class of blocks (:meth:`_Plan.classes`): full blocks whose source offset is a multiple of
        2, 4, ... elements (up to 16 bytes) are read and written in vectors of that many, the rest
        element-wise."""
        if P.contig is not None or not SEGMENT_CLASSES:
            return [(triton.cdiv(P.nblocks, nb),
                     dict(SRC_AL=_src_al(P.contig), **_tile_args(bs, bpc, nb, strides, unaligned=P.contig is None,
                                                                 lanes=lanes, encode=encode)))]
        order, classes = P.classes(flat.element_size(), bs)
        return [(triton.cdiv(count, nb),
                 dict(SRC_AL=a, LISTED=True, blk_ptr=order[start:start + count], blk_count=count,
                      **_tile_args(bs, bpc, nb, strides, unaligned=a == 1, lanes=lanes, encode=encode)))
                for a, start, count in classes]

    def encode(self, flat: torch.Tensor, layout, residual: Optional[torch.Tensor] = None,
               generator: Optional[torch.Generator] = None) -> None:
        """Quantize the unpadded bucket ``flat`` (plus ``residual``) straight into ``layout.send``:
        one launch for block scaling, two for tensor/bucket scaling (the quantize launch split per
        class of blocks with :data:`SEGMENT_CLASSES`: :meth:`_block_launches`)."""
        L, P = layout, self._plan(layout)
        if not flat.is_contiguous():
            raise ValueError("encode needs a contiguous flat bucket")
        bs = L.block_size
        res_mode = _RES_NONE if residual is None else _RES_ENCODE
        res = residual if residual is not None else P.valid
        pay, sc = L.send, L.send.view(torch.float32)
        seed = self._seed(generator, 0)
        dev = flat.device
        nbq = _blocks_per_program(bs, _quant_tile(P.contig))
        source, nsrc = (_SRC_CONTIG, P.contig) if P.contig is not None else (_SRC_SEGMENTS, 1)
        src_al = _src_al(P.contig)
        common = dict(BS=bs, SR=self.stochastic_rounding, DIV_MODE=_DIV_NONE, IDX64=P.idx64, **self._consts())
        launches = self._block_launches(P, flat, bs, L.blocks_per_chunk, nbq, (L.chunk_bytes,), encode=True)
        if L.scaling == "block":
            for nprog, extra in launches:
                self._launch(_quant_kernel, (nprog,), dev,
                             flat, P.src, P.valid, pay, 0, sc, 0, nsrc, 1.0, 1.0, P.valid, P.valid, 0, res, 1.0,
                             pay, L.chunk_bytes, sc[:, P.scale_word0:], P.row_words,
                             P.nblocks, L.blocks_per_chunk, L.groups.groups_per_row, L.groups.num_groups, 1.0, seed,
                             NB=nbq, GB=_GROUPS_PER_PROGRAM, SOURCE=source, AMAX_MODE=_AMAX_TILE_BLOCK,
                             RES_MODE=res_mode, num_warps=_encode_warps(nbq, bs, flat, P.contig), **common, **extra)
            return
        G, ng = L.groups.groups_per_row, L.groups.num_groups
        epoch = P.next_epoch("enc")
        nba = _blocks_per_program(bs, _AMAX_TILE, _AMAX_MAX_BLOCKS)
        self._launch(_amax_kernel, (triton.cdiv(P.nblocks, nba),), dev,
                     flat, P.src, P.valid, pay, 0, sc, 0, P.grp, nsrc, 1.0, 1.0,
                     res, res, res, P.grp, P.gam_enc, epoch, P.nblocks, L.blocks_per_chunk, G,
                     FP8=self._fp8, BS=bs, NB=nba, SOURCE=source, SRC_GROUPED=False, DIV_MODE=_DIV_NONE,
                     HAS_RES=residual is not None, STORE_X=False, STORE_BAMAX=False, ATOMIC=True, IDX64=P.idx64,
                     num_warps=_warps(nba, bs), LW=min(bs, 32), SRC_AL=src_al)
        for i, (nprog, extra) in enumerate(launches):
            ngi = ng if i == 0 else 0  # the first launch also writes every group's scale_inv
            self._launch(_quant_kernel, (max(nprog, triton.cdiv(ngi, _GROUPS_PER_PROGRAM)),), dev,
                         flat, P.src, P.valid, pay, 0, sc, 0, nsrc, 1.0, 1.0, P.grp, P.gam_enc, epoch, res, 1.0,
                         pay, L.chunk_bytes, sc[:, P.scale_word0:], P.row_words,
                         P.nblocks, L.blocks_per_chunk, G, ngi, 1.0, seed,
                         NB=nbq, GB=_GROUPS_PER_PROGRAM, SOURCE=source, AMAX_MODE=_AMAX_EPOCH_GROUP,
                         RES_MODE=res_mode, num_warps=_warps(nbq, bs), **common, **extra)

    def reduce_shard(self, layout, residual: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None) -> None:
        """Dequantize-sum the W received chunks in rank order, take the mean exactly as the
        reference does, requantize into ``gather_in`` and fold W times the requantization error into
        this rank's residual: one launch for block scaling, two for tensor/bucket scaling."""
        L, P = layout, self._plan(layout)
        W, C, bs, bpc = L.world_size, L.chunk_numel, L.block_size, L.blocks_per_chunk
        dev = L.device
        div_mode = _torch_div_mode(dev.type)
        inv_w = 1.0 / W
        res_mode = _RES_NONE if residual is None else _RES_FOLD
        own = residual[L.rank * C:(L.rank + 1) * C] if residual is not None else P.valid
        rp, rs = L.recv, L.recv.view(torch.float32)[:, P.scale_word0:]
        gp, gs = L.gather_in, L.gather_in.view(torch.float32)[P.scale_word0:]
        seed = self._seed(generator, 1)
        nbq = _blocks_per_program(bs, _QUANT_TILE)
        common = dict(BS=bs, SR=self.stochastic_rounding, IDX64=P.idx64, **self._consts())
        unroll = min(_RECV_UNROLL, W)
        if L.scaling == "block":
            # Wide rows (LW 128) with UNROLL sources in flight: the sum reads W payload rows per
            # tile, and narrow rows left the loads too short to hide latency (measured, 64M-512M).
            self._launch(_quant_kernel, (triton.cdiv(bpc, nbq),), dev,
                         rp, rp, rp, rp, L.chunk_bytes, rs, P.row_words, W, inv_w, float(W),
                         own, own, 0, own, float(W), gp, C, gs, bpc,
                         bpc, bpc, bpc, bpc, 1.0, seed,
                         NB=nbq, GB=_GROUPS_PER_PROGRAM, SOURCE=_SRC_RECV, AMAX_MODE=_AMAX_TILE_BLOCK,
                         RES_MODE=res_mode, DIV_MODE=div_mode, num_warps=_warps(nbq, bs), UNROLL=unroll,
                         **_tile_args(bs, bpc, nbq, (L.chunk_bytes, C), lanes=_RECV_LANES, max_al=_RECV_PAY_AL),
                         **common)
            return
        common.update(_tile_args(bs, bpc, nbq, (L.chunk_bytes, C)))
        G = L.own_groups.groups_per_row
        epoch = P.next_epoch("red")
        # The amax pass reads the W payload rows as the block-scaled sum does: wide rows, 16-byte
        # promises, UNROLL sources in flight.
        nba = _blocks_per_program(bs, _RECV_AMAX_TILE, _AMAX_MAX_BLOCKS)
        amax_tile = _tile_args(bs, bpc, nba, (L.chunk_bytes,), lanes=_RECV_AMAX_LANES, max_al=_RECV_PAY_AL)
        self._launch(_amax_kernel, (triton.cdiv(bpc, nba),), dev,
                     rp, rp, rp, rp, L.chunk_bytes, rs, P.row_words, P.own_grp_all, W, inv_w, float(W),
                     L.shard, L.shard, L.shard, P.own_grp, P.gam_red, epoch, bpc, bpc, G,
                     FP8=self._fp8, BS=bs, NB=nba, SOURCE=_SRC_RECV, SRC_GROUPED=True, DIV_MODE=div_mode,
                     HAS_RES=False, STORE_X=True, STORE_BAMAX=False, ATOMIC=True, IDX64=P.idx64,
                     num_warps=_warps(nba, bs), LW=amax_tile["LW"], UNROLL=unroll, PAY_AL=amax_tile["PAY_AL"])
        nprog = max(triton.cdiv(bpc, nbq), triton.cdiv(G, _GROUPS_PER_PROGRAM))
        self._launch(_quant_kernel, (nprog,), dev,
                     L.shard, L.shard, L.shard, rp, 0, rs, 0, 1, 1.0, 1.0, P.own_grp, P.gam_red, epoch,
                     own, float(W), gp, C, gs, G,
                     bpc, bpc, G, G, 1.0, seed,
                     NB=nbq, GB=_GROUPS_PER_PROGRAM, SOURCE=_SRC_DENSE, AMAX_MODE=_AMAX_EPOCH_GROUP,
                     RES_MODE=res_mode, DIV_MODE=_DIV_NONE, num_warps=_warps(nbq, bs), **common)

    # ------------------------------------------------------------------ an FP8 sum's fused stages (nccl_fp8)
    def _flat_source(self, flat: torch.Tensor, P: _Plan):
        if not flat.is_contiguous():
            raise ValueError("an FP8 sum needs a contiguous flat bucket")
        return (_SRC_CONTIG, P.contig) if P.contig is not None else (_SRC_SEGMENTS, 1)

    def shared_amax(self, flat: torch.Tensor, layout, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Group amax of the unpadded bucket ``flat`` (plus ``residual``) into ``layout.group_amax``,
        read through the segment table (no staging copy): one launch for block scaling, two for
        tensor/bucket scaling."""
        L, P = layout, self._plan(layout)
        source, nsrc = self._flat_source(flat, P)
        bs, G, ng = L.block_size, L.groups.groups_per_row, L.groups.num_groups
        res = residual if residual is not None else L.group_amax
        nba = _blocks_per_program(bs, _AMAX_TILE, _AMAX_MAX_BLOCKS)
        grouped = L.groups.block_group is not None
        epoch = P.next_epoch("enc") if grouped else 0
        self._launch(_amax_kernel, (triton.cdiv(P.nblocks, nba),), flat.device,
                     flat, P.src, P.valid, flat, 0, flat, 0, P.grp if grouped else P.valid, nsrc, 1.0, 1.0,
                     res, res, L.group_amax, P.grp if grouped else P.valid, P.gam_enc if grouped else L.group_amax,
                     epoch, P.nblocks, L.blocks_per_chunk, G,
                     FP8=self._fp8, BS=bs, NB=nba, SOURCE=source, SRC_GROUPED=False, DIV_MODE=_DIV_NONE,
                     HAS_RES=residual is not None, STORE_X=False, STORE_BAMAX=not grouped, ATOMIC=grouped,
                     IDX64=P.idx64, num_warps=_warps(nba, bs), LW=min(bs, 32), SRC_AL=_src_al(P.contig))
        if grouped:
            self._launch(_amax_finish_kernel, (triton.cdiv(ng, _GROUPS_PER_PROGRAM),), flat.device,
                         P.gam_enc, L.group_amax, epoch, ng, GB=_GROUPS_PER_PROGRAM)
        return L.group_amax

    def encode_shared(self, flat: torch.Tensor, layout, scale_inv: torch.Tensor, *, pre_scale: float,
                      residual: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None) -> None:
        """Quantize the unpadded bucket ``flat`` (plus ``residual``, updated in the same pass) with the
        shared ``layout.group_amax`` times ``pre_scale`` into ``layout.fp8_wire``: one launch."""
        L, P = layout, self._plan(layout)
        source, nsrc = self._flat_source(flat, P)
        bs, C, bpc = L.block_size, L.chunk_numel, L.blocks_per_chunk
        G, ng = L.groups.groups_per_row, L.groups.num_groups
        grouped = L.groups.block_group is not None
        res_mode = _RES_NONE if residual is None else _RES_ENCODE
        res = residual if residual is not None else P.valid
        sc, sc_stride = self._rows_view(scale_inv, G)
        nbq = _blocks_per_program(bs, _quant_tile(P.contig))
        nprog = triton.cdiv(P.nblocks, nbq)
        if grouped:
            nprog = max(nprog, triton.cdiv(ng, _GROUPS_PER_PROGRAM))
        self._launch(_quant_kernel, (nprog,), flat.device,
                     flat, P.src, P.valid, flat, 0, flat, 0, nsrc, 1.0, 1.0, P.grp if grouped else P.valid,
                     L.group_amax, 0, res, 1.0, L.fp8_wire, C, sc, sc_stride,
                     P.nblocks, bpc, G, ng, float(pre_scale), self._seed(generator, 0),
                     BS=bs, NB=nbq, GB=_GROUPS_PER_PROGRAM, SOURCE=source,
                     AMAX_MODE=_AMAX_F32_GROUP if grouped else _AMAX_F32_BLOCK, RES_MODE=res_mode,
                     SR=self.stochastic_rounding, DIV_MODE=_DIV_NONE, IDX64=P.idx64, num_warps=_warps(nbq, bs),
                     SRC_AL=_src_al(P.contig),
                     **_tile_args(bs, bpc, nbq, (C,), unaligned=P.contig is None, encode=True),
                     **self._consts())

    def decode_mean(self, layout, scale_inv: torch.Tensor, flat: torch.Tensor, saturated: torch.Tensor) -> torch.Tensor:
        """The summed ``layout.fp8_wire`` times ``scale_inv``, divided by W as the reference divides,
        straight into the bucket ``flat`` in its dtype, counting the saturated values of finite
        groups into ``saturated`` (zeroed first): one memset and one launch."""
        L, P = layout, self._plan(layout)
        if not flat.is_contiguous():
            raise ValueError("decode_mean needs a contiguous flat bucket")
        W, bs, C = L.world_size, L.block_size, L.chunk_numel
        G = L.groups.groups_per_row
        grouped = L.groups.block_group is not None
        sc, sc_stride = self._rows_view(scale_inv, G)
        saturated.zero_()
        nb = _blocks_per_program(bs, _quant_tile(P.contig))
        self._launch(_dequant_kernel, (triton.cdiv(P.nblocks, nb),), flat.device,
                     L.fp8_wire, C, sc, sc_stride, P.grp if grouped else P.valid, G, flat, P.src, P.valid,
                     P.nblocks, L.blocks_per_chunk, P.contig or 0, saturated, 1.0 / W, float(W),
                     FP8=self._fp8, BS=bs, NB=nb, GROUPED=grouped, SEGMENTED=True, IDX64=P.idx64,
                     CONTIG=P.contig is not None, DIV_MODE=_torch_div_mode(flat.device.type), COUNT_SAT=True,
                     FMAX=float(self.fmt.fmax), num_warps=_warps(nb, bs),
                     **_tile_args(bs, L.blocks_per_chunk, nb, (C,), unaligned=P.contig is None))
        return flat

    def decode(self, layout, flat: torch.Tensor) -> torch.Tensor:
        """Dequantize ``gather_out`` straight into the bucket ``flat`` in its dtype (one launch, or
        one per class of blocks: :meth:`_block_launches`)."""
        L, P = layout, self._plan(layout)
        if not flat.is_contiguous():
            raise ValueError("decode needs a contiguous flat bucket")
        bs = L.block_size
        grouped = L.groups.block_group is not None
        nb = _blocks_per_program(bs, _quant_tile(P.contig))
        # a contiguous fp32 bucket stores 16 bytes per lane: 16 warps of 128-lane rows kept more
        # stores in flight (0.92 of copy against 0.87 at 64M); bf16 and segmented buckets keep 8 x 32
        wide = (16, 128) if P.contig is not None and flat.dtype == torch.float32 and _warps(nb, bs) == 8 else \
            (_warps(nb, bs), 32)
        for nprog, extra in self._block_launches(P, flat, bs, L.blocks_per_chunk, nb, (L.chunk_bytes,),
                                                 lanes=wide[1]):
            self._launch(_dequant_kernel, (nprog,), flat.device,
                         L.gather_out, L.chunk_bytes, L.gather_out.view(torch.float32)[:, P.scale_word0:],
                         P.row_words, P.grp if grouped else P.valid, L.groups.groups_per_row, flat, P.src, P.valid,
                         P.nblocks, L.blocks_per_chunk, P.contig or 0,
                         FP8=self._fp8, BS=bs, NB=nb, GROUPED=grouped, SEGMENTED=True, IDX64=P.idx64,
                         CONTIG=P.contig is not None, num_warps=wide[0], **extra)
        return flat
