"""The command-line integration (fp8_comm_hook.integrations.cli) and scripts/train.py end to end.

Precedence per field: flag, then FP8_COMM_<FIELD>, then the FP8CommConfig default; bad values raise
ValueError naming the flag or variable. Two short torchrun runs of the trainer (digits with FP8,
charlm with bf16) check that training works through the hooks and that the JSON log is complete.
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fp8_comm_hook
from fp8_comm_hook import FP8CommConfig, add_cli_args, config_from_args, register_grad_comm
from fp8_comm_hook.integrations import cli
from fp8_comm_hook.integrations.cli import grad_comm_from_args
from fp8_comm_hook.registry import grad_comm_wire_dtype

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "scripts", "train.py")


def parse(*argv):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


# ------------------------------------------------------------------------------------- parsing
def test_help_names_every_field_and_its_default():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    text = " ".join(p.format_help().split())
    for field, (flag, *_rest) in cli.FLAGS.items():
        assert flag in text
        assert f"FP8CommConfig.{field}, default" in text
    assert "--no-fp8-error-feedback" in text and "--no-fp8-stochastic-rounding" in text
    assert set(cli.FLAGS) == {f for f in FP8CommConfig().to_dict()}  # every field has a flag


def test_defaults_without_flags_or_env():
    args = parse()
    assert all(getattr(args, dest) is None for _, dest, _, _ in cli.FLAGS.values())
    assert config_from_args(args, environ={}) == FP8CommConfig()
    assert grad_comm_from_args(args, environ={}) == "none"


def test_flag_beats_env_beats_default():
    env = {"FP8_COMM_FP8_FORMAT": "e5m2", "FP8_COMM_BLOCK_SIZE": "64", "FP8_COMM_WARMUP_STEPS": "7"}
    cfg = config_from_args(parse("--fp8-block-size", "256", "--fp8-scaling", "tensor"), environ=env)
    assert cfg.block_size == 256            # flag over env
    assert cfg.scaling == "tensor"          # flag over default
    assert cfg.fp8_format == "e5m2"         # env over default
    assert cfg.warmup_steps == 7
    assert cfg.algorithm == "two_shot"      # default
    assert config_from_args(parse("--fp8-block-size", "256"), environ=env) == cfg.replace(scaling="block")


def test_flag_shadows_a_bad_env_value():
    cfg = config_from_args(parse("--fp8-block-size", "32"), environ={"FP8_COMM_BLOCK_SIZE": "nonsense"})
    assert cfg.block_size == 32


def test_all_value_flags_parse():
    cfg = config_from_args(parse("--fp8-format", "e5m2", "--fp8-scaling", "bucket", "--fp8-block-size", "16",
                                 "--fp8-algorithm", "none", "--fp8-backend", "torch", "--fp8-min-compress-numel", "0",
                                 "--fp8-pre-scale", "0.5", "--fp8-seed", "3", "--fp8-warmup-steps", "2"), environ={})
    assert cfg == FP8CommConfig(fp8_format="e5m2", scaling="bucket", block_size=16, algorithm="none", backend="torch",
                                min_compress_numel=0, pre_scale=0.5, seed=3, warmup_steps=2)
    assert config_from_args(parse("--fp8-pre-scale", "none"), environ={"FP8_COMM_PRE_SCALE": "0.25"}).pre_scale is None


@pytest.mark.parametrize("argv, flag", [
    (["--fp8-format", "e3m4"], "--fp8-format"),
    (["--fp8-scaling", "row"], "--fp8-scaling"),
    (["--fp8-block-size", "100"], "--fp8-block-size"),
    (["--fp8-block-size", "abc"], "--fp8-block-size"),
    (["--fp8-algorithm", "ring"], "--fp8-algorithm"),
    (["--fp8-backend", "cuda"], "--fp8-backend"),
    (["--fp8-min-compress-numel", "-1"], "--fp8-min-compress-numel"),
    (["--fp8-pre-scale", "2"], "--fp8-pre-scale"),
    (["--fp8-pre-scale", "x"], "--fp8-pre-scale"),
    (["--fp8-warmup-steps", "1.5"], "--fp8-warmup-steps"),
    (["--fp8-seed", "-3"], "--fp8-seed"),
])
def test_bad_flag_value_names_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        config_from_args(parse(*argv), environ={})


@pytest.mark.parametrize("var, value", [
    ("FP8_COMM_FP8_FORMAT", "e3m4"), ("FP8_COMM_BLOCK_SIZE", "12"), ("FP8_COMM_ERROR_FEEDBACK", "maybe"),
    ("FP8_COMM_PRE_SCALE", "0"), ("FP8_COMM_MIN_COMPRESS_NUMEL", "lots"),
])
def test_bad_env_value_names_the_variable(var, value):
    with pytest.raises(ValueError, match=var):
        config_from_args(parse(), environ={var: value})


def test_programmatic_namespace_values_are_validated():
    cfg = config_from_args(argparse.Namespace(fp8_block_size=64, fp8_error_feedback=True), environ={})
    assert cfg.block_size == 64 and cfg.error_feedback is True
    with pytest.raises(ValueError, match="--fp8-block-size"):
        config_from_args(argparse.Namespace(fp8_block_size=100), environ={})
    with pytest.raises(ValueError, match="--fp8-error-feedback"):
        config_from_args(argparse.Namespace(fp8_error_feedback=1), environ={})


def test_boolean_flags():
    assert config_from_args(parse("--fp8-error-feedback"), environ={}).error_feedback is True
    assert config_from_args(parse("--fp8-stochastic-rounding"), environ={}).stochastic_rounding is True
    on = {"FP8_COMM_ERROR_FEEDBACK": "yes", "FP8_COMM_STOCHASTIC_ROUNDING": "1"}
    cfg = config_from_args(parse(), environ=on)
    assert cfg.error_feedback is True and cfg.stochastic_rounding is True
    cfg = config_from_args(parse("--no-fp8-error-feedback", "--no-fp8-stochastic-rounding"), environ=on)
    assert cfg.error_feedback is False and cfg.stochastic_rounding is False
    assert config_from_args(parse(), environ={"FP8_COMM_ERROR_FEEDBACK": "off"}).error_feedback is False


def test_grad_comm_precedence_and_errors():
    assert grad_comm_from_args(parse("--grad-comm", "fp8"), environ={"FP8_COMM_GRAD_COMM": "bf16"}) == "fp8"
    assert grad_comm_from_args(parse(), environ={"FP8_COMM_GRAD_COMM": "BF16"}) == "bf16"
    assert grad_comm_from_args(parse(), environ={}) == "none"
    with pytest.raises(ValueError, match="--grad-comm"):
        grad_comm_from_args(parse("--grad-comm", "fp4"), environ={})
    with pytest.raises(ValueError, match="FP8_COMM_GRAD_COMM"):
        grad_comm_from_args(parse(), environ={"FP8_COMM_GRAD_COMM": "int8"})


def test_package_exports():
    for name in ("add_cli_args", "config_from_args", "register_grad_comm"):
        assert name in fp8_comm_hook.__all__ and hasattr(fp8_comm_hook, name)


# ------------------------------------------------------------------------------------- register_grad_comm
@pytest.fixture
def world_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _ddp_grads(grad_comm):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref = [p.detach().clone() for p in net.parameters()]
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = register_grad_comm(model, grad_comm, FP8CommConfig(min_compress_numel=0))
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, r in zip(plain.parameters(), ref):
            p.copy_(r)
    plain(x).square().sum().backward()
    return model, state, [p.grad for p in net.parameters()], [p.grad for p in plain.parameters()]


@pytest.mark.timeout(60)
def test_register_grad_comm_modes(world_of_one, monkeypatch):
    model, state, got, want = _ddp_grads("none")
    assert state is None and grad_comm_wire_dtype(model) == torch.float32
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    model, state, got, want = _ddp_grads("bf16")  # gloo: bf16_allreduce_hook
    assert state is None and grad_comm_wire_dtype(model) == torch.bfloat16
    assert all(torch.equal(g, w.to(torch.bfloat16).float()) for g, w in zip(got, want))

    monkeypatch.setattr(cli, "bf16_all_reduce_works", lambda group, device: False)
    model, state, got, want = _ddp_grads("bf16")  # bf16_emulated_hook
    assert grad_comm_wire_dtype(model) == torch.float32
    assert all(torch.equal(g, w.to(torch.bfloat16).float()) for g, w in zip(got, want))

    model, state, got, want = _ddp_grads("fp8")
    assert state is not None and state.stats()["compressed_buckets"] >= 1
    for g, w in zip(got, want):
        assert torch.linalg.vector_norm(g - w) <= 0.1 * torch.linalg.vector_norm(w)

    with pytest.raises(ValueError, match="grad_comm"):
        _ddp_grads("fp16")


# ------------------------------------------------------------------------------------- end to end
def run_trainer(tmp_path, *argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8_COMM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    log_json = tmp_path / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAIN,
           "--no-progress", "--log-json", str(log_json), *argv]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(log_json.read_text()), proc.stdout


@pytest.mark.timeout(120)
def test_train_digits_fp8(tmp_path):
    steps = 30
    rec, out = run_trainer(tmp_path, "--task", "digits", "--steps", str(steps), "--eval-every", "10",
                           "--grad-comm", "fp8", "--fp8-min-compress-numel", "0")
    s = rec["summary"]
    assert [e["step"] for e in rec["steps"]] == list(range(1, steps + 1))
    assert all(set(e) == {"step", "loss", "lr"} for e in rec["steps"])
    assert [e["step"] for e in rec["evals"]] == [0, 10, 20, 30]
    losses = [e["loss"] for e in rec["steps"]]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert s["final_eval_loss"] < 0.5 * s["initial_eval_loss"]
    assert s["final_accuracy"] > 0.8
    assert (s["grad_comm"], s["world_size"], s["steps"], s["seed"]) == ("fp8", 2, steps, 0)
    assert s["fp8_config"] == FP8CommConfig(min_compress_numel=0).to_dict()
    assert s["hook_stats"]["steps"] == steps and s["hook_stats"]["uncompressed_buckets"] == 0
    assert s["bytes_baseline"] > 0 and s["bytes_sent"] / s["bytes_baseline"] < 0.35
    assert "held-out loss" in out and "accuracy" in out


@pytest.mark.timeout(120)
def test_train_charlm_bf16(tmp_path):
    rec, out = run_trainer(tmp_path, "--task", "charlm", "--steps", "10", "--eval-every", "10", "--grad-comm", "bf16",
                           "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--context", "32",
                           "--batch-size", "8", "--lr", "1e-2", "--corpus-bytes", "200000", "--eval-windows", "0",
                           "--lr-min-ratio", "0")
    s = rec["summary"]
    # --eval-windows 0: every held-out window of 32 bytes (+1 target byte) is evaluated
    assert s["data"]["eval_windows"] == (s["data"]["eval_bytes"] - 1) // 32 > 16
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    assert rec["steps"][-1]["loss"] < rec["steps"][0]["loss"]
    assert s["final_accuracy"] is None and s["fp8_config"] is None
    assert s["bytes_sent"] * 2 == s["bytes_baseline"]  # bf16 ring all-reduce against fp32
    assert s["data"]["held_out_files"] >= 1 and len(s["data"]["sha256"]) == 64


def _train_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_script", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lr_schedule_warmup_cosine_and_floor():
    """Linear warm-up to --lr, cosine down to --lr-min-ratio * --lr at the last step, exactly."""
    train = _train_module()
    for floor in (0.0, 0.1, 1.0):
        args = argparse.Namespace(lr=2e-3, lr_warmup_steps=10, steps=110, lr_min_ratio=floor)
        assert train.lr_at(0, args) == pytest.approx(2e-4)
        assert train.lr_at(9, args) == pytest.approx(2e-3)
        assert train.lr_at(10, args) == pytest.approx(2e-3)
        assert train.lr_at(60, args) == pytest.approx(2e-3 * (floor + (1 - floor) * 0.5))  # half-way
        assert train.lr_at(110, args) == pytest.approx(2e-3 * floor, abs=1e-15)
        lrs = [train.lr_at(k, args) for k in range(10, 111)]
        assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("argv, message", [
    (["--lr-min-ratio", "1.5"], "--lr-min-ratio must be in [0, 1], got 1.5"),
    (["--lr-min-ratio", "-0.1"], "--lr-min-ratio must be in [0, 1]"),
    (["--task", "charlm", "--eval-windows", "-1"], "--eval-windows must be >= 0"),
    (["--init-perturbation=-1e-6"], "--init-perturbation must be a finite number >= 0, got -1e-06"),
    (["--init-perturbation", "nan"], "--init-perturbation must be a finite number >= 0, got nan"),
    (["--grad-perturbation", "inf"], "--grad-perturbation must be a finite number >= 0, got inf"),
])
def test_trainer_schedule_and_eval_argument_errors(argv, message, capsys):
    train = _train_module()
    with pytest.raises(SystemExit) as e:
        train.resolve_args(train.build_parser(), argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_grad_perturbation_needs_ddp(capsys):
    train = _train_module()
    if not hasattr(train.fp8_comm_hook, "register_fsdp_hook"):
        pytest.skip("this fp8_comm_hook has no register_fsdp_hook, so --dp fsdp2 is refused for that first")
    with pytest.raises(SystemExit) as e:
        train.resolve_args(train.build_parser(), ["--dp", "fsdp2", "--grad-perturbation", "1e-6"])
    assert e.value.code == 2 and "--grad-perturbation needs --dp ddp" in capsys.readouterr().err


def test_stdlib_source_files_top_and_tree(tmp_path):
    """top: *.py directly in the root; tree: every package too, sorted by '/'-joined relative path,
    with site-packages, __pycache__ and test packages left out at any depth."""
    train = _train_module()
    files = ["b.py", "a.py", "notes.txt", "pkg/__init__.py", "pkg/z.py", "pkg/sub/m.py", "pkg/tests/t.py",
             "test/test_x.py", "site-packages/x.py", "pkg/__pycache__/z.py", "idlelib/idle_test/i.py", "idlelib/e.py"]
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    assert train.stdlib_source_files(str(tmp_path), "top") == ["a.py", "b.py"]
    assert train.stdlib_source_files(str(tmp_path), "tree") == [
        "a.py", "b.py", "idlelib/e.py", "pkg/__init__.py", "pkg/sub/m.py", "pkg/z.py"]
    with pytest.raises(ValueError, match="files must be one of"):
        train.stdlib_source_files(str(tmp_path), "all")


def test_stdlib_corpus_tree_extends_top():
    """The tree corpus of this interpreter holds more files than the top-level one, the top-level
    corpus is the default, and both split every 10th file off as held-out text."""
    train = _train_module()
    tr_top, ev_top, top = train.load_stdlib_corpus(50_000_000, "top")
    tr_tree, ev_tree, tree = train.load_stdlib_corpus(50_000_000, "tree")
    assert tree["stdlib_files"] > top["stdlib_files"] and tree["train_bytes"] > top["train_bytes"]
    assert (top["corpus_files"], tree["corpus_files"]) == ("top", "tree")
    for info, tr, ev in ((top, tr_top, ev_top), (tree, tr_tree, ev_tree)):
        assert info["held_out_files"] == info["stdlib_files"] // 10
        assert (len(tr), len(ev)) == (info["train_bytes"], info["eval_bytes"])
    assert top["sha256"] == train.load_stdlib_corpus(50_000_000)[2]["sha256"]
