"""studies/compare_convergence.py on a tiny configuration: digits, one seed, 20 steps, three modes
(fp32, FP8 E4M3, FP8 with error feedback: three torchrun worlds of 2, ~25 s on 2 CPU cores). Checks
the JSON schema of convergence.json, its summary, and that the logs and the PNG exist."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "studies", "compare_convergence.py")
RUN_KEYS = {"task", "grad_comm", "fp8_format", "error_feedback", "algorithm", "seed", "world_size",
            "final_eval_loss", "final_accuracy", "steps", "bytes_sent", "bytes_baseline", "log"}

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_tiny_comparison_writes_schema_logs_and_plot(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, SCRIPT, "--tasks", "digits", "--seeds", "0", "--steps-digits", "20",
                           "--modes", "none", "fp8-e4m3", "fp8-e4m3-ef", "--out-dir", str(out)],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "| task | mode | seed |" in proc.stdout

    data = json.loads((out / "convergence.json").read_text())
    runs = data["runs"]
    assert [(r["mode"], r["grad_comm"]) for r in runs] == [("none", "none"), ("fp8-e4m3", "fp8"),
                                                           ("fp8-e4m3-ef", "fp8")]
    for r in runs:
        assert RUN_KEYS <= set(r)
        assert r["task"] == "digits" and r["seed"] == 0 and r["world_size"] == 2 and r["steps"] == 20
        assert r["final_eval_loss"] > 0 and 0 <= r["final_accuracy"] <= 1
        assert r["bytes_baseline"] > 0 and r["bytes_sent"] > 0
        log = r["log"] if os.path.isabs(r["log"]) else os.path.join(REPO, r["log"])
        assert os.path.isfile(log)
        record = json.loads(open(log).read())
        assert record["summary"]["final_eval_loss"] == r["final_eval_loss"]
        assert len(record["evals"]) >= 2
    none, e4m3, ef = runs
    assert none["fp8_format"] is None and none["error_feedback"] is None and none["algorithm"] is None
    assert none["bytes_sent"] == none["bytes_baseline"]
    assert e4m3["fp8_format"] == "e4m3" and e4m3["error_feedback"] is False and e4m3["algorithm"] == "two_shot"
    assert ef["error_feedback"] is True
    assert e4m3["bytes_sent"] < 0.3 * e4m3["bytes_baseline"]  # FP8 + scales: about a quarter of fp32

    s = data["summary"]["digits"]
    assert set(s["none_spread"]) >= {"seeds", "min", "max", "std", "rel_range"}
    assert s["none_spread"]["seeds"] == [0] and s["none_spread"]["std"] == 0.0
    comps = {c["mode"]: c for c in s["comparisons"]}
    assert set(comps) == {"fp8-e4m3", "fp8-e4m3-ef"}
    for c in comps.values():
        assert c["rel_diff"] == pytest.approx(c["final_eval_loss"] / none["final_eval_loss"] - 1)
        assert c["within_1pct"] == (abs(c["rel_diff"]) <= 0.01)
    assert isinstance(s["all_fp8_within_1pct"], bool)
    assert isinstance(s["error_feedback_at_least_as_close"], bool)
    assert (out / "convergence-digits.png").stat().st_size > 1000
    assert not (out / "convergence-charlm.png").exists()
    assert data["summary"]["complete"] is True
    pm = s["per_mode"]["fp8-e4m3"]
    assert pm["seeds"] == [0] and pm["mean_abs_rel_diff"] == pytest.approx(abs(comps["fp8-e4m3"]["rel_diff"]))

    # --resume reuses the three runs; of the four new ones (two at a time) the same-seed fp32 rerun
    # is bit-identical on CPU, the fp32 runs from nudged initial weights and with nudged
    # gradients land a little away, and the one with FP8-sized gradient noise further
    proc = run_script("--tasks", "digits", "--seeds", "0", "--steps-digits", "20", "--jobs", "2",
                      "--modes", "none-rerun", "none-perturbed-init", "none-perturbed-grads", "none-noised-grads-3e-2",
                      "fp8-e4m3", "fp8-e4m3-ef", "--out-dir", str(out), "--resume")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("resumed from") == 3 and proc.stdout.count(": started") == 4
    data2 = json.loads((out / "convergence.json").read_text())
    assert [r["mode"] for r in data2["runs"]] == ["none", "none-rerun", "none-perturbed-init", "none-perturbed-grads",
                                                  "none-noised-grads-3e-2", "fp8-e4m3", "fp8-e4m3-ef"]
    assert data2["runs"][0] == runs[0] and data2["runs"][5] == runs[1]
    comps2 = {c["mode"]: c for c in data2["summary"]["digits"]["comparisons"]}
    assert comps2["none-rerun"]["rel_diff"] == 0.0 and comps2["none-rerun"]["grad_comm"] == "none"
    for mode, key, other in (("none-perturbed-init", "init_perturbation", "grad_perturbation"),
                             ("none-perturbed-grads", "grad_perturbation", "init_perturbation")):
        # the init nudge always lands a little away; the per-step gradient nudge may round away
        # entirely in 20 steps (it changes AdamW's update by ~1e-6 of ~lr, under half an ulp of most
        # weights; on torch 2.13 CPU the final loss is bit-identical), so only its bound is checked
        # here, and the noised run below shows the gradient path takes effect
        assert comps2[mode]["grad_comm"] == "none" and abs(comps2[mode]["rel_diff"]) < 1e-3
        if key == "init_perturbation":
            assert comps2[mode]["rel_diff"] != 0
        row = next(r for r in data2["runs"] if r["mode"] == mode)
        summary = json.loads(open(os.path.join(REPO, row["log"])).read())["summary"]
        assert summary[key] == {"rel": 1e-6, "seed": 1} and summary[other] is None
        assert summary["bytes_sent"] == summary["bytes_baseline"]
    noised = next(r for r in data2["runs"] if r["mode"] == "none-noised-grads-3e-2")
    noised_summary = json.loads(open(os.path.join(REPO, noised["log"])).read())["summary"]
    assert noised_summary["grad_perturbation"] == {"rel": 3e-2, "seed": 1} and noised_summary["grad_comm"] == "none"
    assert abs(comps2["none-noised-grads-3e-2"]["rel_diff"]) > abs(comps2["none-perturbed-grads"]["rel_diff"])
    pm2 = data2["summary"]["digits"]["per_mode"]
    assert pm2["none-perturbed-init"]["within_1pct"] == 1 and pm2["none-rerun"]["within_1pct"] == 1

    # a changed run (other steps) is not resumed
    proc = run_script("--tasks", "digits", "--seeds", "0", "--steps-digits", "10", "--modes", "none",
                      "--out-dir", str(out), "--resume")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "resumed from" not in proc.stdout


def test_bad_arguments_and_failed_runs_are_reported(tmp_path):
    proc = run_script("--seeds", "0", "1", "--compressed-seeds", "2", "--out-dir", str(tmp_path))
    assert proc.returncode != 0 and "--compressed-seeds [2] have no fp32 run" in proc.stdout
    proc = run_script("--jobs", "0", "--out-dir", str(tmp_path))
    assert proc.returncode != 0 and "--jobs must be >= 1" in proc.stdout
    # every run fails (the trainer rejects the block size): the script says which, and exits non-zero
    proc = run_script("--tasks", "digits", "--seeds", "0", "--steps-digits", "5", "--modes", "none", "fp8-e4m3",
                      "--jobs", "2", "--extra-args", "--fp8-block-size 7", "--out-dir", str(tmp_path))
    assert proc.returncode != 0
    assert "2 of 2 runs failed" in proc.stdout and "--fp8-block-size 7" in proc.stdout
    assert json.loads((tmp_path / "convergence.json").read_text())["runs"] == []


def test_charlm_args_reach_its_runs_and_key_resume(tmp_path):
    """--charlm-args go to charlm runs (last the shared --extra-args), are recorded, and are part of
    what --resume matches: the same run with other task args is run again."""
    args = ["--tasks", "charlm", "--seeds", "0", "--modes", "none", "--steps-charlm", "3", "--eval-every-charlm", "3",
            "--device", "cpu", "--out-dir", str(tmp_path), "--extra-args", "--n-layer 1 --d-model 32 --n-head 2"]
    task_args = "--corpus-bytes 200000 --context 32 --eval-windows 0 --lr-min-ratio 0"
    proc = run_script(*args, "--charlm-args", task_args)
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = json.loads((tmp_path / "convergence.json").read_text())
    want = task_args.split() + ["--n-layer", "1", "--d-model", "32", "--n-head", "2"]
    assert data["summary"]["trainer_task_args"] == {"charlm": want}
    record = json.loads((tmp_path / "convergence-logs" / "charlm-none-seed0.json").read_text())
    assert record["comparison_run"]["extra_args"] == want
    a = record["args"]
    assert (a["corpus_bytes"], a["context"], a["eval_windows"], a["lr_min_ratio"], a["d_model"]) == (
        200000, 32, 0, 0.0, 32)
    data_info = record["summary"]["data"]
    assert data_info["eval_windows"] == (data_info["eval_bytes"] - 1) // 32
    assert record["steps"][-1]["lr"] < record["steps"][0]["lr"]

    proc = run_script(*args, "--charlm-args", task_args, "--resume")
    assert proc.returncode == 0 and proc.stdout.count("resumed from") == 1, proc.stdout[-4000:]
    proc = run_script(*args, "--charlm-args", task_args.replace("--lr-min-ratio 0", "--lr-min-ratio 0.5"),
                      "--resume")
    assert proc.returncode == 0 and "resumed from" not in proc.stdout, proc.stdout[-4000:]
