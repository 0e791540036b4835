#!/usr/bin/env python
"""Convergence of FP8 gradient communication against a plain fp32 all-reduce, on the trainer's two
tasks (``scripts/train.py --task digits|charlm``), world 2.

For each task it runs, one torchrun world of 2 at a time (``OMP_NUM_THREADS=1``; the trainer picks
CUDA/NCCL when there are enough GPUs, gloo on CPU otherwise):

  none          ``--grad-comm none`` (fp32 all-reduce), once per ``--seeds`` (default 0 1 2): the
                seed-to-seed spread is the yardstick for every other difference
  bf16          ``--grad-comm bf16``                              (first seed)
  fp8-e4m3      ``--grad-comm fp8``                               (first seed)
  fp8-e5m2      ``--grad-comm fp8 --fp8-format e5m2``             (first seed)
  fp8-e4m3-ef   ``--grad-comm fp8 --fp8-error-feedback``          (first seed)

and writes ``OUT/convergence.json`` (every run's final held-out loss, accuracy, bytes, its per-step
log, and a summary: the spread of the ``none`` seeds and each compressed run's relative difference to
the ``none`` run of the same seed, within 1% or not), one PNG per task (``OUT/convergence-TASK.png``:
eval loss against step, and the relative difference to the fp32 seed-0 curve) and prints a table.
The per-step logs go to ``--log-dir`` (thinned to every Nth training step if one exceeds 300 KB).

    python scripts/compare_convergence.py                       # the full comparison (~20 min on 2 CPU cores)
    python scripts/compare_convergence.py --tasks digits --seeds 0 --steps-digits 20 --out-dir /tmp/cc
"""
import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join("scripts", "train.py")
NPROC = 2
LOG_LIMIT_BYTES = 300_000
WITHIN = 0.01   # the bar: |final eval loss / fp32's - 1| <= 1%

#: mode name -> (grad_comm, extra trainer flags)
MODES = {
    "none": ("none", []),
    "bf16": ("bf16", []),
    "fp8-e4m3": ("fp8", ["--fp8-format", "e4m3"]),
    "fp8-e5m2": ("fp8", ["--fp8-format", "e5m2"]),
    "fp8-e4m3-ef": ("fp8", ["--fp8-format", "e4m3", "--fp8-error-feedback"]),
}
TASKS = ("digits", "charlm")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="seeds of the fp32 (none) runs; the compressed modes run with the first (default 0 1 2)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="modes to run (default: all); 'none' is always run")
    p.add_argument("--steps-digits", type=int, default=300, help="optimizer steps for digits (default 300)")
    p.add_argument("--steps-charlm", type=int, default=600, help="optimizer steps for charlm (default 600)")
    p.add_argument("--eval-every-digits", type=int, default=10, help="steps between evaluations, digits (default 10)")
    p.add_argument("--eval-every-charlm", type=int, default=25, help="steps between evaluations, charlm (default 25)")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"),
                   help="where convergence.json and the PNGs go (default benchmarks/results)")
    p.add_argument("--log-dir", default=None,
                   help="per-step JSON logs (default benchmarks/results/convergence-logs, or OUT-DIR/convergence-logs "
                        "when --out-dir is given)")
    p.add_argument("--extra-args", default="",
                   help="passed to every train.py run, last (so it overrides), e.g. \"--fp8-block-size 64\"")
    return p


def rel_to_repo(path):
    """``path`` relative to the repository root when it lies inside, else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel.replace(os.sep, "/")


def device_args():
    """The trainer picks CUDA when present; NCCL cannot put two ranks on one GPU, so with fewer GPUs
    than ranks run on CPU (gloo) instead."""
    try:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        n = 0
    if 0 < n < NPROC:
        print(f"{n} GPU(s) for {NPROC} ranks: running on CPU (gloo)", file=sys.stderr)
        return ["--device", "cpu"]
    return []


def thin_log(record, path):
    """Rewrite the trainer's log at ``path`` with ``args.log_json`` relative to the repo; if it is
    larger than LOG_LIMIT_BYTES keep every Nth training step (plus the first and last; evals and
    summary untouched)."""
    record["args"]["log_json"] = rel_to_repo(path)
    text = json.dumps(record, indent=1)
    if len(text) > LOG_LIMIT_BYTES:
        steps = record["steps"]
        fixed = len(text) - len(json.dumps(steps, indent=1))
        every = math.ceil(len(json.dumps(steps, indent=1)) / max(1, LOG_LIMIT_BYTES * 0.9 - fixed))
        record["steps"] = [s for i, s in enumerate(steps) if i == 0 or i == len(steps) - 1 or (i + 1) % every == 0]
        record["steps_thinned_every"] = every
        text = json.dumps(record, indent=1)
    with open(path, "w") as f:
        f.write(text)


def run_one(task, mode, seed, steps, eval_every, log_dir, extra):
    """One torchrun world: returns (row for convergence.json, the log record, wall seconds)."""
    grad_comm, flags = MODES[mode]
    log_path = os.path.join(log_dir, f"{task}-{mode}-seed{seed}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC), TRAIN,
           "--task", task, "--grad-comm", grad_comm, *flags, "--seed", str(seed), "--steps", str(steps),
           "--eval-every", str(eval_every), "--no-progress", "--log-json", log_path, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"run failed (rc {proc.returncode}): {shlex.join(cmd)}")
    with open(log_path) as f:
        record = json.load(f)
    thin_log(record, log_path)
    s = record["summary"]
    cfg = s.get("fp8_config") or {}
    row = {
        "task": task, "mode": mode, "grad_comm": s["grad_comm"],
        "fp8_format": cfg.get("fp8_format") if grad_comm == "fp8" else None,
        "error_feedback": cfg.get("error_feedback") if grad_comm == "fp8" else None,
        "algorithm": cfg.get("algorithm") if grad_comm == "fp8" else None,
        "seed": s["seed"], "world_size": s["world_size"],
        "final_eval_loss": s["final_eval_loss"], "final_accuracy": s["final_accuracy"],
        "steps": s["steps"], "bytes_sent": s["bytes_sent"], "bytes_baseline": s["bytes_baseline"],
        "bytes_ratio": s["bytes_sent"] / s["bytes_baseline"] if s["bytes_baseline"] else None,
        "initial_eval_loss": s["initial_eval_loss"], "final_train_loss": s["final_train_loss"],
        "device": s["device"], "backend": s["backend"], "train_time_s": s["train_time_s"], "wall_time_s": wall,
        "log": rel_to_repo(log_path),
    }
    return row, record, wall


def summarize(runs):
    """Per task: spread of the none runs over seeds, and every compressed run against the none run
    of the same seed."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in runs):
        rows = [r for r in runs if r["task"] == task]
        none = {r["seed"]: r for r in rows if r["mode"] == "none"}
        losses = [r["final_eval_loss"] for r in none.values()]
        mean = statistics.fmean(losses)
        spread = {"seeds": sorted(none), "min": min(losses), "max": max(losses), "mean": mean,
                  "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                  "rel_range": (max(losses) - min(losses)) / mean}
        accs = [r["final_accuracy"] for r in none.values() if r["final_accuracy"] is not None]
        if accs:
            spread["accuracy_min"], spread["accuracy_max"] = min(accs), max(accs)
        comps = []
        for r in rows:
            if r["mode"] == "none":
                continue
            ref = none[r["seed"]]
            rel = r["final_eval_loss"] / ref["final_eval_loss"] - 1
            comps.append({"mode": r["mode"], "grad_comm": r["grad_comm"], "fp8_format": r["fp8_format"],
                          "error_feedback": r["error_feedback"], "seed": r["seed"],
                          "final_eval_loss": r["final_eval_loss"], "fp32_final_eval_loss": ref["final_eval_loss"],
                          "rel_diff": rel, "within_1pct": abs(rel) <= WITHIN, "bytes_ratio": r["bytes_ratio"]})
        fp8 = [c for c in comps if c["grad_comm"] == "fp8"]
        task_sum = {"none_spread": spread, "comparisons": comps,
                    "all_fp8_within_1pct": all(c["within_1pct"] for c in fp8) if fp8 else None}
        by_mode = {(c["mode"], c["seed"]): c for c in comps}
        ef = [(c, by_mode.get(("fp8-e4m3", c["seed"]))) for c in comps if c["mode"] == "fp8-e4m3-ef"]
        if ef and all(plain is not None for _, plain in ef):
            task_sum["error_feedback_at_least_as_close"] = all(
                abs(c["rel_diff"]) <= abs(plain["rel_diff"]) for c, plain in ef)
        out[task] = task_sum
    return out


def plot(task, runs, records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in runs if r["task"] == task]
    ref_row = min((r for r in rows if r["mode"] == "none"), key=lambda r: r["seed"])
    ref = {e["step"]: e["eval_loss"] for e in records[ref_row["log"]]["evals"]}
    colors = {"bf16": "tab:green", "fp8-e4m3": "tab:red", "fp8-e5m2": "tab:orange", "fp8-e4m3-ef": "tab:purple"}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for r in rows:
        ev = records[r["log"]]["evals"]
        x = [e["step"] for e in ev]
        y = [e["eval_loss"] for e in ev]
        d = [100 * (e["eval_loss"] / ref[e["step"]] - 1) for e in ev if e["step"] in ref]
        if r["mode"] == "none":
            kw = dict(color="black", lw=0.8, alpha=0.9 if r is ref_row else 0.45,
                      ls="-" if r is ref_row else ":", label=f"fp32 (none) seed {r['seed']}")
        else:
            kw = dict(color=colors.get(r["mode"], None), lw=1.4, label=f"{r['mode']} seed {r['seed']}")
        ax.plot(x, y, **kw)
        if r is not ref_row:
            ax2.plot([e["step"] for e in ev if e["step"] in ref], d, **kw)
    ax.set_yscale("log")
    ax.set_ylabel("held-out loss" + (" (nats/byte)" if task == "charlm" else ""))
    ax.set_title(f"{task}: held-out loss, world {ref_row['world_size']}, {ref_row['device']} / {ref_row['backend']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax2.axhspan(-100 * WITHIN, 100 * WITHIN, color="tab:blue", alpha=0.08, label="±1%")
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_ylabel(f"vs fp32 seed {ref_row['seed']} (%)")
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.3)
    # scale to the compressed modes over the second half (where the bar applies), at least +-1.5%;
    # the other fp32 seeds may run off this scale (their spread is in the summary)
    steps = sorted(ref)
    tail = [100 * (e["eval_loss"] / ref[e["step"]] - 1) for r in rows if r["mode"] != "none"
            for e in records[r["log"]]["evals"] if e["step"] in ref and e["step"] >= steps[len(steps) // 2]]
    lim = max([1.5 * abs(v) for v in tail] + [1.5 * 100 * WITHIN])
    ax2.set_ylim(-lim, lim)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt_table(runs, summary):
    comp = {(t, c["mode"], c["seed"]): c
            for t, s in summary.items() for c in s["comparisons"]}
    head = "| task | mode | seed | final eval loss | rel. diff to fp32 (same seed) | accuracy | bytes sent / fp32 |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in runs:
        c = comp.get((r["task"], r["mode"], r["seed"]))
        rel = "—" if c is None else f"{100 * c['rel_diff']:+.2f}%"
        acc = "—" if r["final_accuracy"] is None else f"{100 * r['final_accuracy']:.2f}%"
        lines.append(f"| {r['task']} | {r['mode']} | {r['seed']} | {r['final_eval_loss']:.4f} | {rel} | {acc} | "
                     f"{r['bytes_ratio']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.log_dir is None:
        a.log_dir = os.path.join(a.out_dir, "convergence-logs")
    out_dir, log_dir = os.path.abspath(a.out_dir), os.path.abspath(a.log_dir)
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    extra = device_args() + shlex.split(a.extra_args)
    modes = ["none"] + [m for m in a.modes if m != "none"]
    plan = []
    for task in a.tasks:
        steps = a.steps_digits if task == "digits" else a.steps_charlm
        every = a.eval_every_digits if task == "digits" else a.eval_every_charlm
        for mode in modes:
            for seed in (a.seeds if mode == "none" else a.seeds[:1]):
                plan.append((task, mode, seed, steps, min(every, steps)))
    runs, records, t_start = [], {}, time.perf_counter()
    for i, (task, mode, seed, steps, every) in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] {task} {mode} seed {seed}, {steps} steps ...", flush=True)
        row, record, wall = run_one(task, mode, seed, steps, every, log_dir, extra)
        runs.append(row)
        records[row["log"]] = record
        ratio = "n/a" if row["bytes_ratio"] is None else f"{row['bytes_ratio']:.4f}"
        print(f"    final eval loss {row['final_eval_loss']:.5f}, bytes ratio {ratio}, {wall:.0f} s", flush=True)
    summary = summarize(runs)
    for task in dict.fromkeys(r["task"] for r in runs):
        plot(task, runs, records, os.path.join(out_dir, f"convergence-{task}.png"))
    total = time.perf_counter() - t_start
    result = {
        "runs": runs,
        "summary": {
            **summary,
            "bar": f"|final eval loss / fp32's (same seed) - 1| <= {WITHIN:.0%}",
            "command": shlex.join(["python", "scripts/compare_convergence.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
            "trainer_extra_args": extra,
            "nproc_per_node": NPROC,
            "total_wall_time_s": total,
        },
    }
    with open(os.path.join(out_dir, "convergence.json"), "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(fmt_table(runs, summary))
    for task, s in summary.items():
        sp = s["none_spread"]
        print(f"{task}: fp32 seeds {sp['seeds']}: final eval loss min {sp['min']:.5f} max {sp['max']:.5f} "
              f"std {sp['std']:.5f} (max-min)/mean {100 * sp['rel_range']:.2f}%; all fp8 within 1%: "
              f"{s['all_fp8_within_1pct']}; error feedback at least as close: "
              f"{s.get('error_feedback_at_least_as_close')}")
    print(f"total wall time {total / 60:.1f} min; wrote {rel_to_repo(os.path.join(out_dir, 'convergence.json'))}")
    return result


if __name__ == "__main__":
    main()
