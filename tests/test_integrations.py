"""Lightning, Accelerate and transformers.Trainer integrations: each example runs as 2 CPU processes over gloo and trains
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


def _check_torchrun_example(script: str, cwd):
    """Run ``examples/SCRIPT --cpu`` as 2 torchrun processes; the model must be DDP-wrapped and train."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "examples", script), "--cpu"],
                       cwd=cwd, env=ENV, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    r = _last_json(p.stdout)
    assert r["wrapped"] == "DistributedDataParallel"
    _check(r)


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
    _check_torchrun_example("accelerate_fp8.py", tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed (pip install transformers)")
def test_transformers_trainer_callback_trains_with_fp8(tmp_path):
    _check_torchrun_example("transformers_trainer_fp8.py", tmp_path)


def test_transformers_callback_without_ddp_registers_nothing(tmp_path, caplog):
    """One process: the Trainer does not wrap the model; the callback says so and leaves it alone."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed (pip install transformers)")
    import logging

    import torch
    from transformers import Trainer, TrainingArguments
    from fp8_comm_hook import FP8CommConfig
    from fp8_comm_hook.integrations.transformers import FP8CommCallback, register_trainer_hook

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.cross_entropy(self.lin(x), labels)}

    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                             save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = Trainer(model=Net(), args=args, train_dataset=rows)
    cb = register_trainer_hook(trainer, FP8CommConfig(fp8_format="e5m2"))
    assert cb in trainer.callback_handler.callbacks and cb.config.fp8_format == "e5m2"
    with caplog.at_level(logging.INFO, logger="fp8_comm_hook"):
        trainer.train()
    assert cb.state is None
    assert "not DDP" in caplog.text and "FP8 hook not registered" in caplog.text
    with pytest.raises(TypeError, match="FP8CommConfig"):
        FP8CommCallback(trainer, {"fp8_format": "e4m3"})


def test_lightning_strategy_rejects_own_hook_arguments():
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning not installed (pip install lightning)")
    from fp8_comm_hook.integrations.lightning import FP8DDPStrategy, lightning_strategy
    from fp8_comm_hook import FP8CommConfig
    with pytest.raises(ValueError, match="config="):
        FP8DDPStrategy(ddp_comm_hook=lambda s, b: None)
    s = lightning_strategy(FP8CommConfig(fp8_format="e5m2"), find_unused_parameters=True)
    assert s.fp8_config.fp8_format == "e5m2" and s._ddp_kwargs == {"find_unused_parameters": True}
