import dataclasses
import pickle

import pytest

from fp8_comm_hook import FP8CommConfig
from fp8_comm_hook.config import DEFAULT_MIN_COMPRESS_NUMEL


def test_defaults():
    c = FP8CommConfig()
    assert (c.fp8_format, c.scaling, c.block_size, c.algorithm) == ("e4m3", "block", 128, "two_shot")
    assert c.pre_scale is None and c.backend == "auto" and c.warmup_steps == 0
    assert c.error_feedback is False and c.stochastic_rounding is False
    assert c.min_compress_numel == DEFAULT_MIN_COMPRESS_NUMEL


def test_frozen_and_picklable():
    c = FP8CommConfig(fp8_format="e5m2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.fp8_format = "e4m3"
    assert pickle.loads(pickle.dumps(c)) == c


@pytest.mark.parametrize("field,value,allowed", [
    ("fp8_format", "e3m4", "e4m3"), ("scaling", "row", "block"), ("algorithm", "ring", "two_shot"),
    ("backend", "cuda", "triton"), ("block_size", 100, "power of two"), ("block_size", 8, "power of two"),
    ("block_size", True, "power of two"), ("pre_scale", 0.0, "(0, 1]"), ("pre_scale", 2.0, "(0, 1]"),
    ("pre_scale", float("nan"), "(0, 1]"), ("error_feedback", 1, "True or False"),
    ("stochastic_rounding", "yes", "True or False"), ("min_compress_numel", -1, ">= 0"),
    ("warmup_steps", 1.5, ">= 0"), ("seed", -3, ">= 0"),
])
def test_bad_values_name_field_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as e:
        FP8CommConfig(**{field: value})
    assert field in str(e.value) and allowed in str(e.value)


def test_from_dict_rejects_unknown_keys():
    assert FP8CommConfig.from_dict({"scaling": "tensor"}).scaling == "tensor"
    with pytest.raises(ValueError, match="blocksize"):
        FP8CommConfig.from_dict({"blocksize": 64})


def test_from_env_parses_every_type():
    env = {"FP8_COMM_FP8_FORMAT": "e5m2", "FP8_COMM_ERROR_FEEDBACK": "1", "FP8_COMM_BLOCK_SIZE": "64",
           "FP8_COMM_PRE_SCALE": "0.5", "FP8_COMM_STOCHASTIC_ROUNDING": "false", "OTHER": "x"}
    c = FP8CommConfig.from_env(env)
    assert c == FP8CommConfig(fp8_format="e5m2", error_feedback=True, block_size=64, pre_scale=0.5)
    assert FP8CommConfig.from_env({"FP8_COMM_PRE_SCALE": "none"}).pre_scale is None
    assert FP8CommConfig.from_env({}) == FP8CommConfig()


@pytest.mark.parametrize("var,value", [("FP8_COMM_FP8_FORMAT", "e4"), ("FP8_COMM_ERROR_FEEDBACK", "maybe"),
                                       ("FP8_COMM_BLOCK_SIZE", "abc"), ("FP8_COMM_BLOCK_SIZE", "100")])
def test_from_env_bad_value_names_variable(var, value):
    with pytest.raises(ValueError, match=var):
        FP8CommConfig.from_env({var: value})


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("FP8_COMM_SCALING", "bucket")
    assert FP8CommConfig.from_env().scaling == "bucket"


def test_fp8_hook_rejects_per_parameter_call():
    """Compiled DDP's python reducer calls a comm hook with (grad, param): fp8_hook compresses whole
    buckets, so it must refuse with an error that says why, not index into a tuple."""
    import torch

    from fp8_comm_hook import FP8CommState, fp8_hook
    state = FP8CommState(FP8CommConfig())
    with pytest.raises(TypeError, match=r"\(grad, param\) tuple"):
        fp8_hook(state, (torch.zeros(3), torch.nn.Parameter(torch.zeros(3))))
    assert state.step == 0
