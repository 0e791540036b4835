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
