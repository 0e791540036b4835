"""The automatic pre_scale rule of nccl_fp8 (the FP8 SUM itself needs NCCL on sm90+; see
tests/test_gpu_core.py): halve on saturation above 1e-5, grow 5% otherwise, within [1/W^2, 1]."""
import math

import pytest
import torch

from codec_ref import make_layout
from fp8_comm_hook.collectives import PRE_SCALE_GROWTH, SATURATION_LIMIT, adapt_pre_scale, next_pre_scale


@pytest.mark.parametrize("W", [2, 3, 8])
def test_rule(W):
    n = 1_000_000
    assert next_pre_scale(0.5, saturated=11, numel=n, world_size=W) == 0.25   # 1.1e-5 > 1e-5
    assert next_pre_scale(0.5, saturated=10, numel=n, world_size=W) == 0.5 * PRE_SCALE_GROWTH
    assert next_pre_scale(0.99, 0, n, W) == 1.0
    floor = 1.0 / W ** 2
    assert next_pre_scale(floor, n, n, W) == floor
    assert SATURATION_LIMIT == 1e-5


def test_adapt_starts_at_inverse_sqrt_world_and_reads_last_saturation():
    L = make_layout([10_000], world_size=4)
    assert adapt_pre_scale(L, 4) == pytest.approx(1 / math.sqrt(4))
    L.auto_pre_scale = 0.5
    L.saturated_last = torch.tensor(L.padded_numel)      # everything saturated last step
    assert adapt_pre_scale(L, 4) == 0.25
    L.saturated_last = torch.tensor(0)
    assert adapt_pre_scale(L, 4) == pytest.approx(0.5 * PRE_SCALE_GROWTH)
