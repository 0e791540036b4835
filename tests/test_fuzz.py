"""Property tests: every config either validates or raises ValueError; the codec never crashes and
keeps its bounds on sizes 0..1e6, every input dtype, magnitudes 1e-38..1e38 and Inf/NaN patterns."""
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec_ref import encode_decode
from fp8_comm_hook import FP8CommConfig
from fp8_comm_hook.formats import get_format

ANY = st.one_of(st.none(), st.booleans(), st.integers(-10, 10_000), st.floats(allow_nan=True),
                st.text(max_size=6), st.sampled_from(["e4m3", "e5m2", "block", "tensor", "bucket", "two_shot",
                                                      "nccl_fp8", "none", "auto", "torch", "triton", "te"]))
FIELDS = ["fp8_format", "scaling", "block_size", "algorithm", "pre_scale", "backend", "error_feedback",
          "stochastic_rounding", "seed", "min_compress_numel", "warmup_steps"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4))
def test_config_validates_or_raises_valueerror(kw):
    try:
        c = FP8CommConfig(**kw)
    except ValueError as e:
        assert any(f in str(e) for f in kw), str(e)  # the message names a field that was set
        return
    assert FP8CommConfig.from_dict(c.to_dict()) == c


@st.composite
def buckets(draw):
    n_params = draw(st.integers(1, 4))
    big = draw(st.booleans())
    numels = [draw(st.integers(0, 250_000 if big else 3000)) for _ in range(n_params)]
    return numels


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numels=buckets(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       log_mag=st.floats(-38, 38), fmt=st.sampled_from(["e4m3", "e5m2"]),
       scaling=st.sampled_from(["block", "tensor", "bucket"]), world=st.integers(1, 5),
       n_bad=st.integers(0, 3), seed=st.integers(0, 2 ** 31 - 1))
def test_codec_bounds_hold(numels, dtype, log_mag, fmt, scaling, world, n_bad, seed):
    n = sum(numels)
    g = torch.Generator().manual_seed(seed)
    fin = torch.finfo(dtype)
    mag = min(10.0 ** log_mag, fin.max / 8)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * mag).clamp(-fin.max, fin.max).to(dtype)
    bad_idx = torch.randint(0, max(n, 1), (n_bad,), generator=g) if n else torch.zeros(0, dtype=torch.long)
    for i, j in enumerate(bad_idx.tolist()):
        x[j] = [float("inf"), float("-inf"), float("nan")][i % 3]
    L, y = encode_decode(x, numels, fmt=fmt, scaling=scaling, world_size=world)
    assert y.shape == x.shape and y.dtype == x.dtype
    finite_in = torch.isfinite(x)
    # a non-finite input makes its scale group non-finite; everything finite elsewhere stays finite
    assert not torch.isfinite(y[~finite_in]).any()
    if n_bad == 0 and n:
        assert torch.isfinite(y).all()
        # per-element error bound: half an FP8 ulp at the element's magnitude, relative to the
        # group's amax for values in the subnormal range, plus the output dtype's own rounding
        f = get_format(fmt)
        xd, yd = x.double(), y.double()
        rel = 2.0 ** -(f.mantissa_bits + 1)
        amax = xd.abs().max()
        bound = rel * xd.abs() + amax * 2.0 ** -(f.mantissa_bits + 1) * 2 ** (-6 if fmt == "e4m3" else -14) * 2
        bound += xd.abs() * fin.eps + fin.tiny * 4
        if scaling == "block":  # exact per-element bound only where the group is one block
            assert torch.all((yd - xd).abs() <= bound * 1.01), ((yd - xd).abs() - bound).max()
        assert (yd - xd).norm() <= 0.08 * xd.norm() + math.sqrt(n) * fin.tiny * 8
