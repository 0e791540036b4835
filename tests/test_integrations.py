"""Lightning and Accelerate integrations: each example runs as 2 CPU processes over gloo and trains
with the FP8 hook registered (stats prove the hook ran, the loss proves training worked)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _last_json(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{out[-3000:]}")


def _check(r: dict):
    assert r["world_size"] == 2
    s = r["stats"]
    assert s["steps"] == 60 and s["compressed_buckets"] == 60
    assert 0.24 < s["bytes_sent"] / s["bytes_baseline"] < 0.30
    assert r["last_loss"] < 0.3 * r["first_loss"]
    assert r["accuracy"] > 0.85


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning not installed (pip install lightning)")
def test_lightning_strategy_trains_with_fp8(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "lightning_fp8.py"), "--devices", "2"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    _check(_last_json(p.stdout))


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed (pip install accelerate)")
def test_accelerate_hook_trains_with_fp8(tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "examples", "accelerate_fp8.py"), "--cpu"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    r = _last_json(p.stdout)
    assert r["wrapped"] == "DistributedDataParallel"
    _check(r)


def test_lightning_strategy_rejects_own_hook_arguments():
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning not installed (pip install lightning)")
    from fp8_comm_hook.integrations.lightning import FP8DDPStrategy, lightning_strategy
    from fp8_comm_hook import FP8CommConfig
    with pytest.raises(ValueError, match="config="):
        FP8DDPStrategy(ddp_comm_hook=lambda s, b: None)
    s = lightning_strategy(FP8CommConfig(fp8_format="e5m2"), find_unused_parameters=True)
    assert s.fp8_config.fp8_format == "e5m2" and s._ddp_kwargs == {"find_unused_parameters": True}
