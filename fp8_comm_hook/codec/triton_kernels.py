"""The Triton kernels of the FP8 codec and the constants that select their variants.

Host code (argument tables, grids, launches) lives in :mod:`fp8_comm_hook.codec.triton_codec`; this
module holds only ``@triton.jit`` functions, so a kernel change is read and reviewed on its own.
Exact-bytes rules the kernels keep (IEEE division, no FMA contraction, clamp before the RNE cast) are
described in :mod:`~fp8_comm_hook.codec.triton_codec`.
"""
import os

import triton
import triton.language as tl

from ..formats import FLOAT32_MAX

_QUANT_TILE = 4096       # elements per program of the quantize / dequantize kernels
_SEGMENT_TILE = 2048     # ... where they read or write the bucket through the segment table
_AMAX_TILE = 8192        # elements per program of the amax kernel
_AMAX_MAX_BLOCKS = 64    # the amax kernel compares every pair of blocks of its tile
_GROUPS_PER_PROGRAM = 1024
_RECV_UNROLL = 4         # received chunks whose loads one iteration of the sum issues together
_RECV_LANES = 128        # lanes per block row of the block-scaled dequantize-sum-requantize
_RECV_PAY_AL = 16        # ... which may promise 16-byte payload rows where their strides allow
_RECV_AMAX_LANES = 128   # lanes per block row of the amax pass of the tensor/bucket-scaled one
_RECV_AMAX_TILE = 4096   # ... and its elements per program
_SEGMENT_LANES = 32      # lanes per block row where the bucket is read through the segment table
_SEGMENT_ENCODE_LANES = 16  # ... in the encodes of such a bucket (measured: bench_codec_configs)
_EPOCH_LIMIT = 2 ** 31 - 1
_INT32_SAFE = 2 ** 31 - 2 ** 20
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_FLT_MAX = tl.constexpr(FLOAT32_MAX)  # scales are clamped to it (a denormal amax gives a finite scale)

# Source of the values a kernel quantizes.
# _SRC_CONTIG: the bucket is one run starting at 0 in both buffers (no padding inside), read with
# plain (vectorisable) loads; ``nsrc`` then holds its valid length.
_SRC_DENSE, _SRC_SEGMENTS, _SRC_RECV, _SRC_CONTIG = 0, 1, 2, 3
# Where the amax of a block's scale comes from.
_AMAX_TILE_BLOCK, _AMAX_EPOCH_GROUP, _AMAX_F32_GROUP, _AMAX_F32_BLOCK = 0, 1, 2, 3
# What happens to the residual (error feedback).
_RES_NONE, _RES_ENCODE, _RES_FOLD = 0, 1, 2
# How the fp32 sum of received chunks becomes a mean.
_DIV_NONE, _DIV_RECIPROCAL, _DIV_TRUE = 0, 1, 2


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def _scales(amax, FMAX: tl.constexpr, pre_scale):
    """The wire rule: (scale, scale_inv) of an fp32 amax vector (NaN counts as non-finite)."""
    finite = amax < float("inf")
    positive = finite & (amax > 0.0)
    s = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax)
    s = tl.minimum(s, _FLT_MAX)
    s = s * pre_scale
    s = tl.where(positive, s, 1.0)
    sinv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s)
    sinv = tl.where(finite, sinv, float("nan"))
    return s, sinv


@triton.jit
def _fp8_bits_to_f32(bits, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Exact fp32 value of FP8 bit patterns (int32 in 0..255) by integer arithmetic. Used for the
    error-feedback residual: on sm90 with Triton 3.6 converting the just-cast FP8 register back to
    fp32 gave wrong values for some elements although the stored bytes were right."""
    s = (bits >> 7) & 1
    e = (bits >> MBITS) & ((1 << (7 - MBITS)) - 1)
    m = bits & ((1 << MBITS) - 1)
    vn = (((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    sub = tl.full(bits.shape, (128 - BIAS - MBITS) << 23, tl.int32).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * sub, vn)
    return tl.where(s == 1, -v, v)


@triton.jit
def _block_amax(x):
    """Max |x| per block of a [NB, KS, LW] tile (block = first axis), NaN reported as +Inf; shape
    [NB, 1, 1]. Axis 1 (inside each thread) is reduced first, so that only one value per block row
    crosses the lanes of a warp: reducing axis 2 first shuffled every one of the KS columns (80
    shuffles per thread of a 4096-element fp32 tile read through the segment table), and the
    shuffles, queued with the loads, held the odd-bucket encode at 61% of copy."""
    ax = tl.abs(x)
    ax = tl.where(ax == ax, ax, float("inf"))
    return tl.max(tl.max(ax, axis=1, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _tile(pid, nblocks, bpc, NB: tl.constexpr, BS: tl.constexpr, LW: tl.constexpr, ONE_WRAP: tl.constexpr,
          IDX64: tl.constexpr):
    """Index tensors of program ``pid``'s tile of NB blocks, laid out [NB, KS, LW] with KS = BS // LW:
    element (r, k, l) is column k * LW + l of block r, so the LW lanes of a warp touch LW consecutive
    elements of one block (coalesced even when the block's source address is unaligned) and a block's
    amax needs no shared memory. Returns (block id [1, NB, 1], its mask, its packed row and block in
    the row, column [1, KS, LW]); warps split the blocks (axis 0)."""
    KS: tl.constexpr = BS // LW
    b0 = pid * NB
    if IDX64:
        b0 = b0.to(tl.int64)
    r = tl.arange(0, NB)[:, None, None]
    b = b0 + r
    bmask = b < nblocks
    # row = b // bpc without a division per block: the tile starts in row0 and, when a row holds
    # at least NB blocks, crosses at most one row boundary.
    row0 = b0 // bpc
    lb0 = b0 - row0 * bpc
    if ONE_WRAP:
        lbr = lb0 + r
        wrap = (lbr >= bpc).to(lbr.dtype)
        row = row0 + wrap
        lb = lbr - wrap * bpc
    else:
        row = b // bpc
        lb = b - row * bpc
    cols = tl.arange(0, KS)[None, :, None] * LW + tl.arange(0, LW)[None, None, :]
    return b, bmask, row, lb, cols


@triton.jit
def _listed_tile(pid, blk_ptr, blk_count, bpc, NB: tl.constexpr, BS: tl.constexpr, LW: tl.constexpr):
    """:func:`_tile` for a launch over a list of blocks: program ``pid`` takes list entries
    [pid * NB, pid * NB + NB) of ``blk_ptr`` (``blk_count`` entries). Same return values."""
    KS: tl.constexpr = BS // LW
    i = pid * NB + tl.arange(0, NB)
    m = i < blk_count
    b = tl.load(blk_ptr + i, mask=m, other=0)[:, None, None]
    bmask = m[:, None, None]
    row = b // bpc
    lb = b - row * bpc
    cols = tl.arange(0, KS)[None, :, None] * LW + tl.arange(0, LW)[None, None, :]
    return b, bmask, row, lb, cols


@triton.jit
def _row_load(ptr, offs, mask, other):
    """``ptr[offs]`` where ``mask``, for offsets and mask of shape [NB, 1, 1] (one value per block
    row: a scale, a segment-table entry, a group index), loaded as a 1-D tensor and expanded back.
    A [NB, 1, 1] load issues one load per element that the tile's layout gives a thread, all of the
    same address: the reduce, whose tile holds 16 payload bytes per thread, loaded every scale 16
    times (72 of its 77 load instructions per thread for W = 8; 12 now)."""
    o = tl.max(tl.max(offs, axis=2), axis=1)
    m = tl.max(tl.max(mask.to(tl.int32), axis=2), axis=1) > 0
    return tl.load(ptr + o, mask=m, other=other)[:, None, None]


@triton.jit
def _stochastic_round(y, seed, offs, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr):
    """Round y (within +-FMAX) to a neighbouring FP8 grid point, up with probability equal to its
    distance from the lower one over the spacing (unbiased); the grid math of the torch codec."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127                      # floor(log2|y|) for normal fp32
    e = tl.maximum(e, MIN_EXP)                           # fixed spacing in the subnormal range
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((MBITS - e + 127) << 23).to(tl.float32, bitcast=True)
    lo = tl.floor(y * inv) * ulp
    frac = (y - lo) * inv
    u = tl.rand(seed, offs.to(tl.int32))
    r = tl.where(u < frac, lo + ulp, lo)
    return tl.minimum(tl.maximum(r, -FMAX), FMAX)


@triton.jit
def _soft_fp8_bits(y, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, BIAS: tl.constexpr):
    """FP8 bits of y (finite, within +-fmax) by round-to-nearest-even in integer/exact fp32 math.
    Used under the Triton interpreter, whose own cast drops the carry into the exponent."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP)
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((MBITS - e + 127) << 23).to(tl.float32, bitcast=True)
    k = (a * inv + 8388608.0) - 8388608.0              # RNE to an integer (a * inv < 2^(MBITS+1), exact)
    r = k * ulp                                        # the rounded magnitude, exactly representable
    rb = r.to(tl.int32, bitcast=True)
    re = ((rb >> 23) & 0xFF) - 127
    normal = (re + BIAS) << MBITS | ((rb >> (23 - MBITS)) & ((1 << MBITS) - 1))
    sub = (r * inv).to(tl.int32)                       # below 2^MIN_EXP, e == MIN_EXP: r / ulp
    out = tl.where(re >= MIN_EXP, normal, sub) | (sign << 7)
    out = tl.where(y == y, out, 0x7F)
    return out.to(tl.uint8)


@triton.jit
def _load_values(b, bmask, cols, x_ptr, src_ptr, valid_ptr, rp_ptr, rp_stride, rs_ptr, rs_stride,
                 sgrp_ptr, nsrc, bpc, G, inv_w, w_f,
                 FP8: tl.constexpr, BS: tl.constexpr, SOURCE: tl.constexpr, SRC_GROUPED: tl.constexpr,
                 DIV_MODE: tl.constexpr, SRC_AL: tl.constexpr = 1, UNROLL: tl.constexpr = 1):
    """The fp32 tile of blocks ``b`` ([NB, 1, 1]; columns ``cols`` [1, KS, LW]): from a dense padded
    buffer, from the unpadded bucket through the segment table, or as the rank-ordered sum of
    ``nsrc`` received chunks.

    SRC_AL (contiguous source): a power of two ``nsrc`` is promised to be a multiple of; the element
    mask is then constant over SRC_AL elements and the loads vectorise (a bf16 bucket otherwise
    issues twice the load instructions per byte of an fp32 one). With the segment table, a SRC_AL
    above 1 promises full blocks whose source offsets are multiples of it (a listed launch).
    UNROLL (received chunks): sources
    loaded per iteration, so that their loads are in flight together; still summed in rank order."""
    if SOURCE == 0:
        x = tl.load(x_ptr + b * BS + cols, mask=bmask, other=0.0)
    elif SOURCE == 1:
        src = _row_load(src_ptr, b, bmask, 0)
        if SRC_AL > 1:  # a listed launch over full blocks whose source is a multiple of SRC_AL
            src = (src // SRC_AL) * SRC_AL
            x = tl.load(x_ptr + src + cols, mask=bmask, other=0.0).to(tl.float32)
        else:
            nv = _row_load(valid_ptr, b, bmask, 0)
            x = tl.load(x_ptr + src + cols, mask=cols < nv, other=0.0).to(tl.float32)
    elif SOURCE == 3:
        if SRC_AL > 1:  # (n // a) * a: the compiler then knows n is a multiple of a
            nsrc = (nsrc // SRC_AL) * SRC_AL
        eo = b * BS + cols
        x = tl.load(x_ptr + eo, mask=bmask & (eo < nsrc), other=0.0).to(tl.float32)
    else:
        poffs = b * BS + cols
        if SRC_GROUPED:
            gidx = _row_load(sgrp_ptr, b, bmask, 0)
        else:
            gidx = b
        # The sum starts from -0.0, which adds exactly (-0 + a == a, signed zeros included), so every
        # source, the first too, is read at s * rp_stride: all of them with the alignment promised
        # for the stride, none wider (a wider first read would widen the whole tile's layout).
        x = tl.full(poffs.shape, -0.0, tl.float32)
        s = 0
        while s < nsrc:  # rank order, as the reference; a while loop also runs under older interpreters
            if UNROLL == 1:
                if SRC_GROUPED:
                    gidx = _row_load(sgrp_ptr, s * bpc + b, bmask, 0) - s * G
                q = tl.load(rp_ptr + s * rp_stride + poffs, mask=bmask, other=0)
                si = _row_load(rs_ptr, s * rs_stride + gidx, bmask, 0.0)
                x = x + q.to(FP8, bitcast=True).to(tl.float32) * si
            else:
                for u in tl.static_range(UNROLL):
                    su = s + u
                    ok = su < nsrc
                    if SRC_GROUPED:
                        gidx = _row_load(sgrp_ptr, su * bpc + b, bmask & ok, 0) - su * G
                    q = tl.load(rp_ptr + su * rp_stride + poffs, mask=bmask & ok, other=0)
                    si = _row_load(rs_ptr, su * rs_stride + gidx, bmask & ok, 0.0)
                    # where, not an added zero: -0.0 + 0.0 would turn a -0.0 sum into +0.0
                    x = tl.where(ok, x + q.to(FP8, bitcast=True).to(tl.float32) * si, x)
            s += UNROLL
        if DIV_MODE == 1:
            x = x * inv_w
        elif DIV_MODE == 2:
            x = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * w_f)
    return x


@triton.jit(do_not_specialize=["nsrc", "epoch", "nblocks", "bpc", "G", "rp_stride", "rs_stride"])
def _amax_kernel(x_ptr, src_ptr, valid_ptr, rp_ptr, rp_stride, rs_ptr, rs_stride, sgrp_ptr, nsrc, inv_w, w_f,
                 res_ptr, xout_ptr, bamax_ptr, grp_ptr, gam_ptr, epoch, nblocks, bpc, G,
                 FP8: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr, SOURCE: tl.constexpr,
                 SRC_GROUPED: tl.constexpr, DIV_MODE: tl.constexpr, HAS_RES: tl.constexpr,
                 STORE_X: tl.constexpr, STORE_BAMAX: tl.constexpr, ATOMIC: tl.constexpr, IDX64: tl.constexpr,
                 LW: tl.constexpr = 32, PAY_AL: tl.constexpr = 1, SRC_AL: tl.constexpr = 1, UNROLL: tl.constexpr = 1):
    """Load (and optionally store) a tile of blocks, compute block amaxes, and fold them into the
    epoch-tagged group amax with one atomic max per run of equal groups in the tile."""
    pid = tl.program_id(0)
    if PAY_AL > 1:  # (s // a) * a: the compiler then knows the stride is a multiple of a
        rp_stride = (rp_stride // PAY_AL) * PAY_AL
    b, bmask, _, _, cols = _tile(pid, nblocks, nblocks, NB, BS, LW, True, IDX64)
    x = _load_values(b, bmask, cols, x_ptr, src_ptr, valid_ptr, rp_ptr, rp_stride, rs_ptr, rs_stride, sgrp_ptr,
                     nsrc, bpc, G, inv_w, w_f, FP8, BS, SOURCE, SRC_GROUPED, DIV_MODE, SRC_AL, UNROLL)
    eoffs = b * BS + cols
    if HAS_RES:
        x = x + tl.load(res_ptr + eoffs, mask=bmask, other=0.0)
    if STORE_X:
        tl.store(xout_ptr + eoffs, x, mask=bmask)
    if STORE_BAMAX or ATOMIC:
        a = tl.max(tl.max(_block_amax(x), axis=2), axis=1)
        rows = tl.arange(0, NB)
        b1 = pid * NB + rows
        if IDX64:
            b1 = b1.to(tl.int64)
        bm1 = b1 < nblocks
        a = tl.where(bm1, a, 0.0)
        if STORE_BAMAX:
            tl.store(bamax_ptr + b1, a, mask=bm1)
        if ATOMIC:
            g = tl.load(grp_ptr + b1, mask=bm1, other=-1)
            same = (g[:, None] == g[None, :]) & bm1[None, :]
            gmax = tl.max(tl.where(same, a[None, :], 0.0), axis=1)
            gprev = tl.load(grp_ptr + b1 - 1, mask=bm1 & (rows > 0), other=-1)
            first = bm1 & ((rows == 0) | (g != gprev))
            tagged = (epoch.to(tl.int64) << 32) | gmax.to(tl.int32, bitcast=True).to(tl.int64)
            tl.atomic_max(gam_ptr + g, tagged, mask=first, sem="relaxed")


@triton.jit(do_not_specialize=["epoch", "ngroups"])
def _amax_finish_kernel(gam_ptr, out_ptr, epoch, ngroups, GB: tl.constexpr):
    """fp32 group amax from the epoch-tagged buffer (0 for groups without blocks)."""
    gi = tl.program_id(0) * GB + tl.arange(0, GB)
    gm = gi < ngroups
    v = tl.load(gam_ptr + gi, mask=gm, other=0)
    a = v.to(tl.int32).to(tl.float32, bitcast=True)
    a = tl.where((v >> 32) == epoch, a, 0.0)
    tl.store(out_ptr + gi, a, mask=gm)


@triton.jit(do_not_specialize=["nsrc", "epoch", "seed", "nblocks", "bpc", "G", "ngroups", "rp_stride",
                               "rs_stride", "pay_stride", "sc_stride"])
def _quant_kernel(x_ptr, src_ptr, valid_ptr, rp_ptr, rp_stride, rs_ptr, rs_stride, nsrc, inv_w, w_f,
                  grp_ptr, amax_ptr, epoch, res_ptr, res_scale,
                  pay_ptr, pay_stride, sc_ptr, sc_stride,
                  nblocks, bpc, G, ngroups, pre_scale, seed,
                  FP8: tl.constexpr, FMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
                  BIAS: tl.constexpr, SOFT_FP8: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr, GB: tl.constexpr,
                  SOURCE: tl.constexpr,
                  AMAX_MODE: tl.constexpr, RES_MODE: tl.constexpr, SR: tl.constexpr, DIV_MODE: tl.constexpr,
                  IDX64: tl.constexpr, LW: tl.constexpr = 32, PAY_AL: tl.constexpr = 1,
                  ONE_WRAP: tl.constexpr = False, SRC_AL: tl.constexpr = 1, UNROLL: tl.constexpr = 1,
                  blk_ptr=None, blk_count=0, LISTED: tl.constexpr = False):
    """Quantize a tile of blocks into packed rows (payload bytes + fp32 scale_inv per group).

    AMAX_MODE 0: each block's own amax (block scaling, one pass); 1: the group's amax from the
    epoch-tagged buffer; 2: the group's fp32 amax; 3: an fp32 amax per block. In modes 1 and 2 the
    program also writes scale_inv for groups [pid * GB, pid * GB + GB).
    RES_MODE 1 (encode): x += res, res = x - dequant(q). RES_MODE 2 (fold): res += res_scale * (x - dequant(q)).
    In both, a residual element whose new value is not finite keeps its old one.
    PAY_AL: the byte alignment promised for payload rows (their stride); 1 where the source is read
    unaligned, so that no access is widened past what the unaligned loads can coalesce.
    LISTED: the program's blocks come from the list ``blk_ptr`` (``blk_count`` entries), one launch
    per class of blocks (:meth:`TritonCodec._segment_classes`).
    """
    pid = tl.program_id(0)
    if PAY_AL > 1:  # (s // a) * a: the compiler then knows the stride is a multiple of a
        pay_stride = (pay_stride // PAY_AL) * PAY_AL
        rp_stride = (rp_stride // PAY_AL) * PAY_AL
    if LISTED:
        b, bmask, row, lb, cols = _listed_tile(pid, blk_ptr, blk_count, bpc, NB, BS, LW)
    else:
        b, bmask, row, lb, cols = _tile(pid, nblocks, bpc, NB, BS, LW, ONE_WRAP, IDX64)
    x = _load_values(b, bmask, cols, x_ptr, src_ptr, valid_ptr, rp_ptr, rp_stride, rs_ptr, rs_stride, grp_ptr,
                     nsrc, bpc, G, inv_w, w_f, FP8, BS, SOURCE, False, DIV_MODE, SRC_AL, UNROLL)
    eoffs = b * BS + cols
    if RES_MODE == 1:
        r_old = tl.load(res_ptr + eoffs, mask=bmask, other=0.0)
        x = x + r_old
    if AMAX_MODE == 0:
        amax = _block_amax(x)
    elif AMAX_MODE == 1:
        g = _row_load(grp_ptr, b, bmask, 0)
        v = _row_load(amax_ptr, g, bmask, 0)
        amax = v.to(tl.int32).to(tl.float32, bitcast=True)
    elif AMAX_MODE == 2:
        g = _row_load(grp_ptr, b, bmask, 0)
        amax = _row_load(amax_ptr, g, bmask, 0.0)
    else:
        amax = _row_load(amax_ptr, b, bmask, 0.0)
    scale, sinv = _scales(amax, FMAX, pre_scale)
    y = x * scale
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    if SR:
        y = _stochastic_round(y, seed, eoffs, MBITS, MIN_EXP, FMAX)
    if SOFT_FP8 or RES_MODE != 0:
        # With a residual the payload is also decoded in registers; on sm90 with Triton 3.6 the
        # hardware cast then stored wrong bytes for some element pairs (measured on an H200), so the
        # exact integer RNE cast is used there.
        qb = _soft_fp8_bits(y, MBITS, MIN_EXP, BIAS)
    else:
        qb = y.to(FP8).to(tl.uint8, bitcast=True)
    tl.store(pay_ptr + row * pay_stride + lb * BS + cols, qb, mask=bmask)
    if AMAX_MODE == 0 or AMAX_MODE == 3:
        tl.store(sc_ptr + row * sc_stride + lb, sinv, mask=bmask)
    if RES_MODE != 0:
        dq = _fp8_bits_to_f32(qb.to(tl.int32), MBITS, BIAS) * sinv
        # A non-finite update (the group held an Inf or NaN) keeps the residual from before the
        # step (the reference's keep_finite_).
        if RES_MODE == 1:
            r_new = x - dq
        else:
            r_old = tl.load(res_ptr + eoffs, mask=bmask, other=0.0)
            r_new = r_old + (x - dq) * res_scale
        r_new = tl.where(tl.abs(r_new) < float("inf"), r_new, r_old)
        tl.store(res_ptr + eoffs, r_new, mask=bmask)
    if AMAX_MODE == 1 or AMAX_MODE == 2:
        if pid * GB < ngroups:
            gi = pid * GB + tl.arange(0, GB)
            gm = gi < ngroups
            if AMAX_MODE == 1:
                gv = tl.load(amax_ptr + gi, mask=gm, other=0)
                ga = gv.to(tl.int32).to(tl.float32, bitcast=True)   # low 32 bits: the amax
                ga = tl.where((gv >> 32) == epoch, ga, 0.0)
            else:
                ga = tl.load(amax_ptr + gi, mask=gm, other=0.0)
            _, gsinv = _scales(ga, FMAX, pre_scale)
            grow = gi // G
            tl.store(sc_ptr + grow * sc_stride + (gi - grow * G), gsinv, mask=gm)


@triton.jit(do_not_specialize=["G", "nblocks", "bpc", "pay_stride", "sc_stride"])
def _dequant_kernel(pay_ptr, pay_stride, sc_ptr, sc_stride, grp_ptr, G, out_ptr, src_ptr, valid_ptr,
                    nblocks, bpc, nvalid, sat_ptr=None, inv_w=1.0, w_f=1.0,
                    FP8: tl.constexpr = None, BS: tl.constexpr = 128, NB: tl.constexpr = 1,
                    GROUPED: tl.constexpr = False, SEGMENTED: tl.constexpr = False, IDX64: tl.constexpr = False,
                    CONTIG: tl.constexpr = False, LW: tl.constexpr = 32, PAY_AL: tl.constexpr = 1,
                    ONE_WRAP: tl.constexpr = False, DIV_MODE: tl.constexpr = 0, COUNT_SAT: tl.constexpr = False,
                    FMAX: tl.constexpr = 0.0, SRC_AL: tl.constexpr = 1, blk_ptr=None, blk_count=0,
                    LISTED: tl.constexpr = False):
    """``q * scale_inv`` per block of packed rows, into a dense fp32 buffer or (SEGMENTED) straight
    into the unpadded bucket in its dtype, skipping padding. An FP8 sum's last stage adds: DIV_MODE
    1/2, the mean as the reference takes it (times ``inv_w`` / IEEE division by ``w_f``, after the
    dequantization); COUNT_SAT, the values at +-FMAX whose dequantized value is not NaN added to the
    int64 ``sat_ptr[0]`` (one atomic per program)."""
    pid = tl.program_id(0)
    if PAY_AL > 1:  # (s // a) * a: the compiler then knows the stride is a multiple of a
        pay_stride = (pay_stride // PAY_AL) * PAY_AL
    if LISTED:
        b, bmask, row, lb, cols = _listed_tile(pid, blk_ptr, blk_count, bpc, NB, BS, LW)
    else:
        b, bmask, row, lb, cols = _tile(pid, nblocks, bpc, NB, BS, LW, ONE_WRAP, IDX64)
    if GROUPED:
        gl = _row_load(grp_ptr, b, bmask, 0) - row * G
    else:
        gl = lb
    q = tl.load(pay_ptr + row * pay_stride + lb * BS + cols, mask=bmask, other=0)
    si = _row_load(sc_ptr, row * sc_stride + gl, bmask, 0.0)
    qf = q.to(FP8, bitcast=True).to(tl.float32)
    v = qf * si
    if COUNT_SAT:
        sat = (tl.abs(qf) >= FMAX) & (v == v) & bmask
        n = tl.sum(tl.sum(tl.sum(sat.to(tl.int32), axis=1), axis=1), axis=0)  # in-thread axis first
        tl.atomic_add(sat_ptr, n.to(tl.int64), sem="relaxed")
    if DIV_MODE == 1:
        v = v * inv_w
    elif DIV_MODE == 2:
        v = tl.math.div_rn(v, tl.full(v.shape, 1.0, tl.float32) * w_f)
    if CONTIG:  # one run from offset 0: plain stores of the first nvalid elements
        eo = b * BS + cols
        tl.store(out_ptr + eo, v.to(out_ptr.dtype.element_ty), mask=bmask & (eo < nvalid))
    elif SEGMENTED:
        src = _row_load(src_ptr, b, bmask, 0)
        if SRC_AL > 1:  # a listed launch over full blocks whose destination is a multiple of SRC_AL
            src = (src // SRC_AL) * SRC_AL
            tl.store(out_ptr + src + cols, v.to(out_ptr.dtype.element_ty), mask=bmask)
        else:
            nv = _row_load(valid_ptr, b, bmask, 0)
            tl.store(out_ptr + src + cols, v.to(out_ptr.dtype.element_ty), mask=cols < nv)
    else:
        tl.store(out_ptr + b * BS + cols, v, mask=bmask)
