#!/usr/bin/env python
"""Convergence of FP8 gradient communication against a plain fp32 all-reduce, on the trainer's two
tasks (``scripts/train.py --task digits|charlm``), world 2.

For each task it runs torchrun worlds of 2 (``OMP_NUM_THREADS=1``; ``--jobs`` of them at a time;
``--device``: ``auto`` takes CUDA/NCCL when there are at least 2 GPUs and the CPU (gloo) otherwise,
``cuda`` with fewer GPUs than ranks lets the ranks share the GPU through gloo with CUDA tensors):

  none          ``--grad-comm none`` (fp32 all-reduce), once per ``--seeds`` (default 0 1 2): the
                seed-to-seed spread is the yardstick for every other difference
  none-rerun    ``--grad-comm none`` again (``--compressed-seeds``; only with ``--modes none-rerun``): the
                same-seed fp32 rerun: bit-identical on CPU; on one H200 with the ranks sharing it
                over gloo, 11 of 12 charlm seeds were bit-identical and one differed by 6e-9 in the
                final loss (a nondeterministic GPU reduction): it measures how far two fp32 runs of
                one seed drift apart
  none-perturbed-init   ``--grad-comm none --init-perturbation 1e-6`` (``--compressed-seeds``): fp32
                from initial weights nudged once by 1e-6 relative (~8 float32 ulps)
  none-perturbed-grads  ``--grad-comm none --grad-perturbation 1e-6`` (``--compressed-seeds``): fp32
                with every step's averaged gradient nudged by 1e-6 relative, about what summing in
                another order does to an fp32 all-reduce. With none-perturbed-init, how far the
                training's own chaos carries a same-seed fp32 run: the yardstick for every compressed
                mode's per-seed difference (bf16 rounds by ~2e-3 per step, FP8 by ~3e-2)
  none-noised-grads-2e-3, none-noised-grads-3e-2   ``--grad-comm none --grad-perturbation 2e-3`` / ``3e-2``
                (``--compressed-seeds``; only when named in ``--modes``): fp32 with unbiased gradient noise
                as large as bf16's / FP8 E4M3's measured error of the averaged gradient (2.3e-3 / 3.3e-2
                per step, ``studies/measure_error_feedback.py --task charlm``): how far any gradient
                error of that size carries a run, whatever its structure, so a compressed mode's
                per-seed difference can be set against noise of its own size rather than a 1e-6 nudge
  bf16          ``--grad-comm bf16``                              (``--compressed-seeds``)
  fp8-e4m3      ``--grad-comm fp8``                               (``--compressed-seeds``)
  fp8-e5m2      ``--grad-comm fp8 --fp8-format e5m2``             (``--compressed-seeds``)
  fp8-e4m3-ef   ``--grad-comm fp8 --fp8-error-feedback``          (``--compressed-seeds``)

``--compressed-seeds`` defaults to the first of ``--seeds``; every compressed run is compared with
the fp32 run of its own seed, so each of them needs a ``none`` run of that seed.

It writes ``OUT/convergence.json`` after every finished run (so an interrupted comparison keeps
what it ran) with every run's final held-out loss, accuracy, bytes, its per-step
log, and a summary: the spread of the ``none`` seeds and each compressed run's relative difference to
the ``none`` run of the same seed, within 1% or not), one PNG per task (``OUT/convergence-TASK.png``:
eval loss against step, and each run's relative difference to the fp32 curve of its seed) and prints
a table.
Every run of a task gets that task's ``--digits-args`` / ``--charlm-args`` (see ``TASK_ARGS``), then
``--extra-args``. The per-step logs go to ``--log-dir`` (thinned to every Nth training step if one exceeds 300 KB).
They are not kept in git (``benchmarks/results/**/convergence-logs/`` is ignored): ``convergence.json`` keeps
every run's numbers and the command that made it, and rerunning that command regenerates the logs
(``--resume`` reuses the logs that are there and runs the rest; see ``docs/convergence.md``).

    python studies/compare_convergence.py                       # the default comparison, 18 runs on the CPU
    python studies/compare_convergence.py --tasks digits --seeds 0 --steps-digits 20 --out-dir /tmp/cc
    python studies/compare_convergence.py --device cuda --jobs 6 --seeds 0 1 2 3 --compressed-seeds 0 1 2 3
"""
import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join("scripts", "train.py")
NPROC = 2
LOG_LIMIT_BYTES = 300_000
WITHIN = 0.01   # the bar: |final eval loss / fp32's - 1| <= 1%
#: trainer flags of every run of a task (``--digits-args`` / ``--charlm-args`` replace them). charlm: the
#: stdlib's packages too (9.3 MB of training text on Python 3.12, seen ~2 times by 2400 steps of 2x32
#: windows; the trainer's 2 MB default is seen ~5 times and overfits, its held-out loss moving by
#: 0.3-1.3% between evaluations 100 steps apart at the end), the cosine decayed to 0 so the final
#: weights settle, and 4096 held-out windows per evaluation, evenly spaced.
TASK_ARGS = {"digits": "", "charlm": "--corpus-files tree --corpus-bytes 30000000 --batch-size 32 --lr-min-ratio 0 "
                                     "--eval-windows 4096"}

#: the relative nudge of the none-perturbed-* modes (see the module docstring)
PERTURBATION = 1e-6
#: relative gradient noise of the none-noised-grads-* modes: bf16's and FP8 E4M3's per-step error, rounded
NOISE_BF16_SIZE, NOISE_FP8_SIZE = 2e-3, 3e-2
#: mode name -> (grad_comm, extra trainer flags)
MODES = {
    "none": ("none", []),
    "none-rerun": ("none", []),
    "none-perturbed-init": ("none", ["--init-perturbation", repr(PERTURBATION)]),
    "none-perturbed-grads": ("none", ["--grad-perturbation", repr(PERTURBATION)]),
    "none-noised-grads-2e-3": ("none", ["--grad-perturbation", repr(NOISE_BF16_SIZE)]),
    "none-noised-grads-3e-2": ("none", ["--grad-perturbation", repr(NOISE_FP8_SIZE)]),
    "bf16": ("bf16", []),
    "fp8-e4m3": ("fp8", ["--fp8-format", "e4m3"]),
    "fp8-e5m2": ("fp8", ["--fp8-format", "e5m2"]),
    "fp8-e4m3-ef": ("fp8", ["--fp8-format", "e4m3", "--fp8-error-feedback"]),
}
TASKS = ("digits", "charlm")
#: diagnostics run only when named in --modes
NOT_BY_DEFAULT = ("none-rerun", "none-noised-grads-2e-3", "none-noised-grads-3e-2")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="seeds of the fp32 (none) runs (default 0 1 2)")
    p.add_argument("--compressed-seeds", nargs="+", type=int, default=None,
                   help="seeds of the bf16 and fp8 runs, each a subset of --seeds (default: the first of --seeds)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=[m for m in MODES if m not in NOT_BY_DEFAULT],
                   help=f"modes to run (default: all but {', '.join(NOT_BY_DEFAULT)}); 'none' is always run")
    p.add_argument("--steps-digits", type=int, default=300, help="optimizer steps for digits (default 300)")
    p.add_argument("--steps-charlm", type=int, default=600, help="optimizer steps for charlm (default 600)")
    p.add_argument("--eval-every-digits", type=int, default=10, help="steps between evaluations, digits (default 10)")
    p.add_argument("--eval-every-charlm", type=int, default=100,
                   help="steps between evaluations, charlm (default 100)")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"),
                   help="where convergence.json and the PNGs go (default benchmarks/results)")
    p.add_argument("--log-dir", default=None,
                   help="per-step JSON logs (default benchmarks/results/convergence-logs, or OUT-DIR/convergence-logs "
                        "when --out-dir is given)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA/NCCL with >= 2 GPUs, else CPU/gloo; cuda: on one GPU the ranks share it "
                        "through gloo (default auto)")
    p.add_argument("--jobs", type=int, default=1,
                   help="torchrun worlds run at a time (default 1; each rank uses one CPU thread)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the log of every planned run already in --log-dir with the same task, mode, "
                        "seed, steps, eval interval, task args and --extra-args (on any device); run the rest")
    for task in TASKS:
        p.add_argument(f"--{task}-args", default=TASK_ARGS[task],
                       help=f"trainer flags of every {task} run (default: {TASK_ARGS[task]!r})")
    p.add_argument("--extra-args", default="",
                   help="passed to every train.py run, last (so it overrides), e.g. \"--fp8-block-size 64\"")
    return p


def rel_to_repo(path):
    """``path`` relative to the repository root when it lies inside, else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel.replace(os.sep, "/")


def device_args(device="auto"):
    """Trainer flags for ``--device``. NCCL cannot put two ranks on one GPU: with fewer GPUs than
    ranks, ``auto`` runs on CPU (gloo) and ``cuda`` shares the GPUs through gloo with CUDA tensors."""
    try:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        n = 0
    if device == "cpu":
        return ["--device", "cpu"]
    if device == "cuda":
        if n == 0:
            raise SystemExit("--device cuda: no CUDA device")
        if n < NPROC:
            print(f"{n} GPU(s) for {NPROC} ranks: the ranks share them through gloo", file=sys.stderr)
            return ["--device", "cuda", "--backend", "gloo"]
        return ["--device", "cuda"]
    if 0 < n < NPROC:
        print(f"{n} GPU(s) for {NPROC} ranks: running on CPU (gloo)", file=sys.stderr)
        return ["--device", "cpu"]
    return []


def thin_log(record, path, run_key, wall):
    """Rewrite the trainer's log at ``path`` with ``args.log_json`` relative to the repo, the run's
    identity (``run_key``, what ``--resume`` matches) and its wall time; if it is larger than
    LOG_LIMIT_BYTES keep every Nth training step (plus the first and last; evals and summary
    untouched)."""
    record["args"]["log_json"] = rel_to_repo(path)
    record["comparison_run"] = run_key
    record["wall_time_s"] = wall
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


class RunFailed(RuntimeError):
    """A trainer run exited non-zero; the message holds its command and the tail of its output."""


def log_path_of(task, mode, seed, log_dir):
    return os.path.join(log_dir, f"{task}-{mode}-seed{seed}.json")


def run_key_of(task, mode, seed, steps, eval_every, user_extra):
    """What identifies a run for ``--resume``: everything that shapes the curve except the device."""
    return {"task": task, "mode": mode, "seed": seed, "steps": steps, "eval_every": eval_every,
            "extra_args": list(user_extra)}


def run_one(task, mode, seed, steps, eval_every, log_dir, device_extra, user_extra):
    """One torchrun world: returns (row for convergence.json, the log record, wall seconds)."""
    grad_comm, flags = MODES[mode]
    log_path = log_path_of(task, mode, seed, log_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC), TRAIN,
           "--task", task, "--grad-comm", grad_comm, *flags, "--seed", str(seed), "--steps", str(steps),
           "--eval-every", str(eval_every), "--no-progress", "--log-json", log_path, *device_extra, *user_extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RunFailed(f"run failed (rc {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-6000:]}")
    with open(log_path) as f:
        record = json.load(f)
    thin_log(record, log_path, run_key_of(task, mode, seed, steps, eval_every, user_extra), wall)
    return row_of(task, mode, record, log_path), record, wall


def resumed_run(task, mode, seed, steps, eval_every, log_dir, user_extra):
    """(row, record, wall) from an earlier run's log in ``log_dir`` when it is the same run
    (see :func:`run_key_of`), else None."""
    log_path = log_path_of(task, mode, seed, log_dir)
    try:
        with open(log_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if record.get("comparison_run") != run_key_of(task, mode, seed, steps, eval_every, user_extra):
        return None
    return row_of(task, mode, record, log_path), record, record.get("wall_time_s")


def row_of(task, mode, record, log_path):
    """The convergence.json row of one run from its trainer log."""
    grad_comm = MODES[mode][0]
    s = record["summary"]
    cfg = s.get("fp8_config") or {}
    return {
        "task": task, "mode": mode, "grad_comm": s["grad_comm"],
        "fp8_format": cfg.get("fp8_format") if grad_comm == "fp8" else None,
        "error_feedback": cfg.get("error_feedback") if grad_comm == "fp8" else None,
        "algorithm": cfg.get("algorithm") if grad_comm == "fp8" else None,
        "seed": s["seed"], "world_size": s["world_size"],
        "final_eval_loss": s["final_eval_loss"], "final_accuracy": s["final_accuracy"],
        "steps": s["steps"], "bytes_sent": s["bytes_sent"], "bytes_baseline": s["bytes_baseline"],
        "bytes_ratio": s["bytes_sent"] / s["bytes_baseline"] if s["bytes_baseline"] else None,
        "initial_eval_loss": s["initial_eval_loss"], "final_train_loss": s["final_train_loss"],
        "device": s["device"], "backend": s["backend"], "train_time_s": s["train_time_s"],
        "wall_time_s": record.get("wall_time_s"),
        "log": rel_to_repo(log_path),
    }


def summarize(runs):
    """Per task: spread of the none runs over seeds, every compressed run against the none run of
    the same seed, and per compressed mode the mean signed / mean absolute / largest absolute
    difference over its seeds."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in runs):
        rows = [r for r in runs if r["task"] == task]
        none = {r["seed"]: r for r in rows if r["mode"] == "none"}
        if not none:
            continue
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
            if r["mode"] == "none" or r["seed"] not in none:
                continue
            ref = none[r["seed"]]
            rel = r["final_eval_loss"] / ref["final_eval_loss"] - 1
            comps.append({"mode": r["mode"], "grad_comm": r["grad_comm"], "fp8_format": r["fp8_format"],
                          "error_feedback": r["error_feedback"], "seed": r["seed"],
                          "final_eval_loss": r["final_eval_loss"], "fp32_final_eval_loss": ref["final_eval_loss"],
                          "rel_diff": rel, "within_1pct": abs(rel) <= WITHIN, "bytes_ratio": r["bytes_ratio"]})
        per_mode = {}
        for mode in dict.fromkeys(c["mode"] for c in comps):
            d = [c["rel_diff"] for c in comps if c["mode"] == mode]
            per_mode[mode] = {"seeds": [c["seed"] for c in comps if c["mode"] == mode],
                              "mean_rel_diff": statistics.fmean(d),
                              "mean_abs_rel_diff": statistics.fmean(abs(x) for x in d),
                              "max_abs_rel_diff": max(abs(x) for x in d),
                              "within_1pct": sum(abs(x) <= WITHIN for x in d)}
        fp8 = [c for c in comps if c["grad_comm"] == "fp8"]
        task_sum = {"none_spread": spread, "comparisons": comps, "per_mode": per_mode,
                    "all_fp8_within_1pct": all(c["within_1pct"] for c in fp8) if fp8 else None}
        by_mode = {(c["mode"], c["seed"]): c for c in comps}
        ef = [(c, by_mode.get(("fp8-e4m3", c["seed"]))) for c in comps if c["mode"] == "fp8-e4m3-ef"]
        if ef and all(plain is not None for _, plain in ef):
            # per seed (every seed must hold), and on the mean |difference| over the same seeds
            task_sum["error_feedback_at_least_as_close"] = all(
                abs(c["rel_diff"]) <= abs(plain["rel_diff"]) for c, plain in ef)
            task_sum["error_feedback_mean_abs_at_least_as_close"] = (
                statistics.fmean(abs(c["rel_diff"]) for c, _ in ef)
                <= statistics.fmean(abs(plain["rel_diff"]) for _, plain in ef))
        out[task] = task_sum
    return out


def plot(task, runs, records, path, comparisons):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in runs if r["task"] == task]
    nones = {r["seed"]: r for r in rows if r["mode"] == "none"}
    rows = [r for r in rows if r["seed"] in nones]
    ref_row = nones[min(nones)]
    curve = {seed: {e["step"]: e["eval_loss"] for e in records[r["log"]]["evals"]} for seed, r in nones.items()}
    colors = {"none-rerun": "tab:gray", "none-perturbed-init": "tab:brown", "none-perturbed-grads": "tab:olive",
              "none-noised-grads-2e-3": "tab:cyan", "none-noised-grads-3e-2": "tab:pink",
              "bf16": "tab:green", "fp8-e4m3": "tab:red", "fp8-e5m2": "tab:orange", "fp8-e4m3-ef": "tab:purple"}
    modes = [m for m in MODES if m != "none" and any(r["mode"] == m for r in rows)]
    fig = plt.figure(figsize=(8, 7.5 + (3 if modes else 0)))
    grid = fig.add_gridspec(3 if modes else 2, 1, height_ratios=[3, 2, 2.2] if modes else [3, 2])
    ax = fig.add_subplot(grid[0])
    ax2 = fig.add_subplot(grid[1], sharex=ax)
    labelled = set()
    for r in rows:
        ev = records[r["log"]]["evals"]
        x = [e["step"] for e in ev]
        y = [e["eval_loss"] for e in ev]
        # compressed runs against the fp32 run of their seed; other fp32 seeds against the first
        ref = curve[ref_row["seed"] if r["mode"] == "none" else r["seed"]]
        d = [100 * (e["eval_loss"] / ref[e["step"]] - 1) for e in ev if e["step"] in ref]
        if r["mode"] == "none":
            label = "fp32 (none)" + ("" if r is ref_row else f", other seeds (vs seed {ref_row['seed']})")
            kw = dict(color="black", lw=0.8, alpha=0.9 if r is ref_row else 0.45, ls="-" if r is ref_row else ":")
        else:
            label = r["mode"]
            kw = dict(color=colors.get(r["mode"], None), lw=1.2, alpha=0.85)
        if label not in labelled:
            kw["label"] = label
            labelled.add(label)
        ax.plot(x, y, **kw)
        if r is not ref_row:
            ax2.plot([e["step"] for e in ev if e["step"] in ref], d, **kw)
    ax.set_yscale("log")
    ax.set_ylabel("held-out loss" + (" (nats/byte)" if task == "charlm" else ""))
    seeds = sorted({r["seed"] for r in rows})
    ax.set_title(f"{task}: held-out loss, world {ref_row['world_size']}, {ref_row['device']} / {ref_row['backend']}, "
                 f"seeds {', '.join(map(str, seeds))}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax2.axhspan(-100 * WITHIN, 100 * WITHIN, color="tab:blue", alpha=0.08, label="±1%")
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_ylabel("vs fp32, same seed (%)")
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.3)
    # scale to the compressed modes over the second half (where the bar applies), at least +-1.5%;
    # the other fp32 seeds may run off this scale (their spread is in the summary)
    steps = sorted(curve[ref_row["seed"]])
    tail = [100 * (e["eval_loss"] / curve[r["seed"]][e["step"]] - 1) for r in rows if r["mode"] != "none"
            for e in records[r["log"]]["evals"] if e["step"] in curve[r["seed"]] and e["step"] >= steps[len(steps) // 2]]
    lim = max([1.5 * abs(v) for v in tail] + [1.5 * 100 * WITHIN])
    ax2.set_ylim(-lim, lim)
    if modes:
        final_diffs(fig.add_subplot(grid[2]), modes, comparisons, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def final_diffs(ax, modes, comparisons, colors):
    """One column per mode: each seed's final eval loss relative to fp32's of that seed (dots; the
    ``rel_diff`` of :func:`summarize`'s comparisons), their mean (bar), and the 1% band: where the
    per-seed bar and the fp32 yardsticks can be read side by side."""
    for i, mode in enumerate(modes):
        d = sorted((c["seed"], 100 * c["rel_diff"]) for c in comparisons if c["mode"] == mode)
        jitter = [i + 0.25 * (k / max(1, len(d) - 1) - 0.5) for k in range(len(d))]  # seeds left to right
        ax.scatter(jitter, [v for _, v in d], s=14, color=colors.get(mode), zorder=3)
        mean = statistics.fmean(v for _, v in d)
        ax.plot([i - 0.2, i + 0.2], [mean, mean], color="black", lw=1.5, zorder=4)
    ax.axhspan(-100 * WITHIN, 100 * WITHIN, color="tab:blue", alpha=0.08)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(modes, fontsize=8, rotation=15)
    ax.set_ylabel("final, vs fp32 same seed (%)")
    ax.set_title("final held-out loss per seed (dots, seeds in order) and mean (bar); band: ±1%", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


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


def write_results(runs, records, argv, extra, task_extra, a, out_dir, t_start, final, planned):
    """Summarize ``runs`` (plan order) and write convergence.json (and, when ``final``, the PNGs)."""
    summary = summarize(runs)
    if final:
        for task in summary:
            plot(task, runs, records, os.path.join(out_dir, f"convergence-{task}.png"),
                 summary[task]["comparisons"])
    result = {
        "runs": runs,
        "summary": {
            **summary,
            "bar": f"|final eval loss / fp32's (same seed) - 1| <= {WITHIN:.0%}",
            "command": shlex.join(["python", "studies/compare_convergence.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
            "trainer_extra_args": extra,
            "trainer_task_args": task_extra,
            "nproc_per_node": NPROC,
            "jobs": a.jobs,
            "complete": final and len(runs) == planned,
            "total_wall_time_s": time.perf_counter() - t_start,
        },
    }
    tmp = os.path.join(out_dir, "convergence.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "convergence.json"))
    return result


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {a.jobs}")
    compressed_seeds = a.seeds[:1] if a.compressed_seeds is None else a.compressed_seeds
    missing = sorted(set(compressed_seeds) - set(a.seeds))
    if missing:
        raise SystemExit(f"--compressed-seeds {missing} have no fp32 run: add them to --seeds {a.seeds}")
    if a.log_dir is None:
        a.log_dir = os.path.join(a.out_dir, "convergence-logs")
    out_dir, log_dir = os.path.abspath(a.out_dir), os.path.abspath(a.log_dir)
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    device_extra, user_extra = device_args(a.device), shlex.split(a.extra_args)
    extra = device_extra + user_extra
    task_extra = {task: shlex.split(getattr(a, f"{task}_args")) + user_extra for task in a.tasks}
    modes = ["none"] + [m for m in a.modes if m != "none"]
    plan = []
    for task in a.tasks:
        steps = a.steps_digits if task == "digits" else a.steps_charlm
        every = a.eval_every_digits if task == "digits" else a.eval_every_charlm
        for mode in modes:
            for seed in (a.seeds if mode == "none" else compressed_seeds):
                plan.append((task, mode, seed, steps, min(every, steps)))
    done, records, t_start, lock = {}, {}, time.perf_counter(), threading.Lock()

    def one(i):
        task, mode, seed, steps, every = plan[i]
        with lock:
            print(f"[{i + 1}/{len(plan)}] {task} {mode} seed {seed}, {steps} steps: started", flush=True)
        return i, run_one(task, mode, seed, steps, every, log_dir, device_extra, task_extra[task])

    todo = []
    for i, (task, mode, seed, steps, every) in enumerate(plan):
        got = resumed_run(task, mode, seed, steps, every, log_dir, task_extra[task]) if a.resume else None
        if got is None:
            todo.append(i)
        else:
            done[i], records[got[0]["log"]] = got[0], got[1]
            print(f"[{i + 1}/{len(plan)}] {task} {mode} seed {seed}: resumed from {got[0]['log']} "
                  f"({got[0]['device']}), final eval loss {got[0]['final_eval_loss']:.5f}", flush=True)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = [pool.submit(one, i) for i in todo]
        failed = []
        try:
            for fut in as_completed(futures):
                try:
                    i, (row, record, wall) = fut.result()
                except RunFailed as e:  # the other runs go on; the script exits non-zero at the end
                    with lock:
                        failed.append(str(e).splitlines()[0])
                        print(e, file=sys.stderr, flush=True)
                    continue
                with lock:
                    done[i] = row
                    records[row["log"]] = record
                    ratio = "n/a" if row["bytes_ratio"] is None else f"{row['bytes_ratio']:.4f}"
                    print(f"[{i + 1}/{len(plan)}] {row['task']} {row['mode']} seed {row['seed']}: final eval loss "
                          f"{row['final_eval_loss']:.5f}, bytes ratio {ratio}, {wall:.0f} s "
                          f"({len(done)}/{len(plan)} done)", flush=True)
                    write_results([done[k] for k in sorted(done)], records, argv, extra, task_extra, a, out_dir,
                                  t_start, final=False, planned=len(plan))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    runs = [done[k] for k in sorted(done)]
    result = write_results(runs, records, argv, extra, task_extra, a, out_dir, t_start, final=True,
                           planned=len(plan))
    summary = {k: v for k, v in result["summary"].items() if k in a.tasks}
    total = result["summary"]["total_wall_time_s"]
    print()
    print(fmt_table(runs, summary))
    for task, s in summary.items():
        sp = s["none_spread"]
        print(f"{task}: fp32 seeds {sp['seeds']}: final eval loss min {sp['min']:.5f} max {sp['max']:.5f} "
              f"std {sp['std']:.5f} (max-min)/mean {100 * sp['rel_range']:.2f}%; all fp8 within 1%: "
              f"{s['all_fp8_within_1pct']}; error feedback at least as close: every seed "
              f"{s.get('error_feedback_at_least_as_close')}, on mean |diff| "
              f"{s.get('error_feedback_mean_abs_at_least_as_close')}")
        for mode, m in s["per_mode"].items():
            print(f"    {mode:20s} seeds {m['seeds']}: mean diff {100 * m['mean_rel_diff']:+.2f}%, mean |diff| "
                  f"{100 * m['mean_abs_rel_diff']:.2f}%, max |diff| {100 * m['max_abs_rel_diff']:.2f}%, within 1% "
                  f"{m['within_1pct']}/{len(m['seeds'])}")
    print(f"total wall time {total / 60:.1f} min; wrote {rel_to_repo(os.path.join(out_dir, 'convergence.json'))}")
    if failed:
        raise SystemExit(f"{len(failed)} of {len(plan)} runs failed (the rest are in convergence.json):\n"
                         + "\n".join(failed))
    return result


if __name__ == "__main__":
    main()
