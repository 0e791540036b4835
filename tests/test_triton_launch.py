"""Host-side launch choices of the Triton codec (no kernel runs): the alignment a launch promises its
kernels must divide every payload stride it covers, and segment-table launches keep their own tile
and lanes. A wrong promise would let the compiler widen loads past a row boundary on the GPU, so it is
checked here, where CI can run it. Skipped when triton is not installed (CI has torch only)."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the launch-choice tests import the Triton codec "
                                       "(pip install triton); CI installs torch only")


@pytest.fixture(scope="module")
def tc():
    from fp8_comm_hook.codec import triton_codec
    return triton_codec


@pytest.mark.parametrize("strides", [(135168, 131072), (33 * 128 + 4, 128), (8650752, 8388608), (4 * 33, 128),
                                     (6, 2), (7,), (24, 16)])
@pytest.mark.parametrize("max_al", [1, 2, 4, 16])
def test_promised_payload_alignment_divides_every_stride(tc, strides, max_al):
    al = tc._tile_args(128, 64, 32, strides, max_al=max_al)["PAY_AL"]
    assert al <= max(1, max_al)
    assert all(s % al == 0 for s in strides), (strides, al)
    # the largest such power of two up to max_al: nothing is given away either
    best = max(p for p in (1, 2, 4, 8, 16) if p <= max(1, max_al) and all(s % p == 0 for s in strides))
    assert al == best


def test_reduce_may_promise_sixteen_bytes_and_the_rest_four(tc):
    wide = (8650752, 8388608)  # a 64M-element bucket at W = 8: chunk_bytes and chunk_numel
    assert tc._tile_args(128, 65536, 32, wide, max_al=tc._RECV_PAY_AL)["PAY_AL"] == 16
    assert tc._tile_args(128, 65536, 32, wide)["PAY_AL"] == 4


@pytest.mark.parametrize("block_size", [16, 128, 8192])
def test_unaligned_sources_promise_nothing_and_use_segment_lanes(tc, block_size, monkeypatch):
    args = tc._tile_args(block_size, 8, 16, (4096,), unaligned=True, lanes=128, max_al=16)
    assert args["PAY_AL"] == 1
    assert args["LW"] == min(block_size, tc._SEGMENT_LANES)
    monkeypatch.setattr(tc, "_SEGMENT_LANES", 16)
    assert tc._tile_args(block_size, 8, 16, (4096,), unaligned=True)["LW"] == min(block_size, 16)
    # an encode takes its own lane count, so that encode and decode can differ
    monkeypatch.setattr(tc, "_SEGMENT_ENCODE_LANES", 8)
    assert tc._tile_args(block_size, 8, 16, (4096,), unaligned=True, encode=True)["LW"] == min(block_size, 8)
    assert tc._tile_args(block_size, 8, 16, (4096,), unaligned=True)["LW"] == min(block_size, 16)
    # aligned launches keep the lanes they ask for, capped at the block size
    assert tc._tile_args(block_size, 8, 16, (4096,), lanes=128)["LW"] == min(block_size, 128)


def test_segment_table_launches_use_their_own_tile(tc, monkeypatch):
    assert tc._quant_tile(None) == tc._SEGMENT_TILE
    assert tc._quant_tile(0) == tc._QUANT_TILE          # an empty bucket is one (empty) contiguous run
    assert tc._quant_tile(1 << 20) == tc._QUANT_TILE
    monkeypatch.setattr(tc, "_SEGMENT_TILE", 1024)
    assert tc._quant_tile(None) == 1024
    assert tc._blocks_per_program(128, tc._quant_tile(None)) == 8


@pytest.mark.parametrize("n,al", [(64, 16), (40, 8), (12, 4), (6, 2), (7, 1), (None, 1), (0, 1)])
def test_contiguous_source_alignment(tc, n, al):
    assert tc._src_al(n) == al


@pytest.mark.parametrize("esize,vec", [(4, 4), (2, 8)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_segment_classes_partition_the_blocks_by_source_alignment(tc, esize, vec, block_size):
    """Every block is in exactly one class; a block in class a > 1 is full and its source offset is
    a multiple of a (the kernels read it in vectors of a elements without a mask); class 1 holds
    every partial or padding block."""
    import torch
    from fp8_comm_hook.layout import BucketLayout
    numels = [256, 130, 512, 8, 1000, 2, 640, 33, 4096]
    offs = [sum(numels[:i]) for i in range(len(numels))]
    dtype = torch.float32 if esize == 4 else torch.bfloat16
    L = BucketLayout(numels, offs, [f"p{i}" for i in range(len(numels))], 3, 0, block_size, "block", sum(numels),
                     dtype, "cpu")
    P = tc._Plan(L)
    order, classes = P.classes(esize, block_size)
    assert sorted(order.tolist()) == list(range(P.nblocks))
    assert [a for a, _, _ in classes] == sorted({a for a, _, _ in classes}, reverse=True)
    src, valid = P.src.tolist(), P.valid.tolist()
    seen = set()
    for a, start, count in classes:
        assert a in (1, 2, 4, 8) and a <= vec
        for b in order[start:start + count].tolist():
            if a > 1:
                assert valid[b] == block_size and src[b] % a == 0, (a, b, src[b], valid[b])
            else:  # class 1: what no wider class may take
                assert valid[b] < block_size or src[b] % 2 == 1, (b, src[b], valid[b])
            seen.add(a)
    assert 1 in seen and vec in seen
    assert P.classes(esize, block_size)[0] is order  # derived once per element size
