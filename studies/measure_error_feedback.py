#!/usr/bin/env python
"""What error feedback buys, measured without training noise: the FP8 all-reduce's error accumulated
along one fixed trajectory, with and without error feedback.

Final losses of separate runs (``compare_convergence.py``) cannot show it: any perturbation of the
gradients, bf16's as much as FP8's, sends a run down a different path whose final loss differs from
fp32's by about the seed-to-seed spread. Here the trajectory is held fixed instead ("teacher
forcing"): a world of ``--world`` ranks (gloo, CPU) trains the trainer's ``--task`` with the exact
fp64 mean of the ranks' gradients, and at every step the same local gradients also go through
``fp8_comm_hook.all_reduce`` for each compressed mode (E4M3 and E5M2, each with and without error
feedback; each mode keeps its own residual), and through the trainer's bf16 all-reduce. For mode
``m`` and step ``t`` it records

  step error     ||g_m(t) - g(t)|| / ||g(t)||           the per-step error (error feedback adds the
                                                       residual, so this is not where it helps)
  drift          ||sum_{s<=t} (g_m(s) - g(t))|| / ||sum_{s<=t} g(s)||
                                                       what an SGD-like optimizer integrates: error
                                                       feedback keeps the numerator bounded (it is
                                                       minus the mean residual), without it it grows

where ``g`` is the exact mean. The trainer's optimizer is AdamW, which does not integrate the
gradients but m_hat / (sqrt(v_hat) + eps) of their moments, so each mode also feeds its own Adam moments
(``ShadowAdam``, the optimizer's betas and eps, each mode's gradient clipped by its own norm like the
trainer's) and is set against the moments fed with ``g``; with ``u`` the exact update direction and
``lr`` the step's learning rate it records

  update error   ||u_m(t) - u(t)|| / ||u(t)||
  update along   <u_m(t), u(t)> / ||u(t)||^2           below 1: the mode moves the weights less far
                                                       along the exact direction
  displacement drift  ||sum_{s<=t} lr(s) (u_m(s) - u(s))|| / ||sum_{s<=t} lr(s) u(s)||
                                                       what the weights integrate (weight decay left
                                                       out: the same for every mode on one trajectory)

It prints a table at a few steps and writes ``--out`` (JSON) and a PNG next to it (gradient drift,
step error and displacement drift against step).

    python studies/measure_error_feedback.py --task charlm --steps 300 --out benchmarks/results/error-feedback-charlm.json
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPTS = os.path.join(REPO, "scripts")  # the trainer, scripts/train.py, whose tasks and schedule this reuses

#: mode name -> FP8CommConfig overrides (None: the trainer's bf16 recipe, as torch's bf16_compress_hook: cast
#: to bf16, divide by the world size, SUM all-reduce in bf16, cast back)
MODES = {
    "bf16": None,
    "fp8-e4m3": dict(fp8_format="e4m3", error_feedback=False),
    "fp8-e4m3-ef": dict(fp8_format="e4m3", error_feedback=True),
    "fp8-e5m2": dict(fp8_format="e5m2", error_feedback=False),
    "fp8-e5m2-ef": dict(fp8_format="e5m2", error_feedback=True),
}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("digits", "charlm"), default="charlm")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "error-feedback.json"),
                   help="JSON output; the PNG goes next to it with the same stem")
    p.add_argument("--train-args", default="",
                   help="extra scripts/train.py flags for the task (e.g. \"--batch-size 8\"); the trainer's "
                        "--fp8-* flags set the compressed modes' shared config (default block size etc.)")
    return p


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def set_grads(model, flat):
    o = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[o:o + n].view_as(p))
        o += n


class ShadowAdam:
    """Adam's bias-corrected moments in float64, fed one gradient per ``update``: what
    ``torch.optim.Adam`` would move a parameter by at learning rate 1 (without weight decay)."""

    def __init__(self, numel, betas=(0.9, 0.999), eps=1e-8):
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.m = torch.zeros(numel, dtype=torch.float64)
        self.v = torch.zeros(numel, dtype=torch.float64)
        self.t = 0

    def update(self, grad):
        """Take in this step's gradient; return the update direction m_hat / (sqrt(v_hat) + eps)."""
        self.t += 1
        self.m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        v_hat = (self.v / (1 - self.beta2 ** self.t)).sqrt_().add_(self.eps)
        return (self.m / (1 - self.beta1 ** self.t)).div_(v_hat)


def clipped(grad, max_norm):
    """``grad`` scaled as ``torch.nn.utils.clip_grad_norm_`` scales it (unchanged when ``max_norm`` <= 0)."""
    if max_norm <= 0:
        return grad
    return grad * min(1.0, max_norm / (grad.norm().item() + 1e-6))


def worker(rank, a, store_path, result_path):
    sys.path.insert(0, SCRIPTS)
    import shlex

    import train as trainer
    import fp8_comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, a.world), rank=rank, world_size=a.world)
    try:
        argv = ["--task", a.task, "--steps", str(a.steps), "--seed", str(a.seed), "--device", "cpu",
                "--grad-comm", "fp8", *shlex.split(a.train_args)]
        args, _, base = trainer.resolve_args(trainer.build_parser(), argv)
        task = trainer.TASKS[a.task](args, torch.device("cpu"), rank, a.world)
        torch.manual_seed(args.seed)
        model = task.build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        configs = {m: base.replace(**MODES[m]) for m in a.modes if MODES[m] is not None}
        numel = sum(p.numel() for p in model.parameters())
        drift = {m: torch.zeros(numel, dtype=torch.float64) for m in a.modes}
        total = torch.zeros(numel, dtype=torch.float64)
        group = opt.param_groups[0]
        adam = {m: ShadowAdam(numel, group["betas"], group["eps"]) for m in (None, *a.modes)}  # None: exact
        displacement = {m: torch.zeros(numel, dtype=torch.float64) for m in (None, *a.modes)}
        rows = []
        t0 = time.perf_counter()
        for step in range(a.steps):
            lr = trainer.lr_at(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=False)
            loss = task.loss(model, step)
            loss.backward()
            local = flat_grads(model)
            exact = local.double()
            dist.all_reduce(exact)
            exact.div_(a.world)
            total.add_(exact)
            norm, total_norm = exact.norm().item(), total.norm().item()
            row = {"step": step + 1, "loss": loss.item(), "lr": lr, "grad_norm": norm}
            u = adam[None].update(clipped(exact, args.grad_clip))
            displacement[None].add_(u, alpha=lr)
            u_sq, disp_norm = u.dot(u).item(), displacement[None].norm().item()
            for m in a.modes:
                if MODES[m] is None:
                    got = local.to(torch.bfloat16).div_(a.world)
                    dist.all_reduce(got)
                    got = got.double()
                else:
                    got = fp8_comm_hook.all_reduce(local.clone(), configs[m]).double()
                err = got - exact
                drift[m].add_(err)
                u_m = adam[m].update(clipped(got, args.grad_clip))
                displacement[m].add_(u_m, alpha=lr)
                row[m] = {"step_error": err.norm().item() / norm, "drift": drift[m].norm().item() / total_norm,
                          "update_error": (u_m - u).norm().item() / math.sqrt(u_sq),
                          "update_along": u_m.dot(u).item() / u_sq,
                          "displacement_drift": ((displacement[m] - displacement[None]).norm().item() / disp_norm
                                                 if disp_norm > 0 else math.nan)}
            rows.append(row)
            if rank == 0 and ((step + 1) % max(1, a.steps // 10) == 0 or step + 1 == a.steps):
                print(f"step {step + 1}/{a.steps} ({time.perf_counter() - t0:.0f} s): loss {row['loss']:.4f}, drift "
                      + ", ".join(f"{m} {row[m]['drift']:.2e}" for m in a.modes), file=sys.stderr, flush=True)
            set_grads(model, exact.float())  # every mode sees the fp32 trajectory
            trainer.clip_grads(model, args.grad_clip)
            opt.step()
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"rows": rows, "parameters": numel, "train_time_s": time.perf_counter() - t0,
                           "config": {m: configs[m].to_dict() for m in configs}, "task_info": task.info,
                           "trainer_args": {k: v for k, v in vars(args).items() if k != "log_json"}}, f)
    finally:
        dist.destroy_process_group()


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, modes = result["rows"], result["modes"]
    colors = {"bf16": "tab:green", "fp8-e4m3": "tab:red", "fp8-e4m3-ef": "tab:purple", "fp8-e5m2": "tab:orange",
              "fp8-e5m2-ef": "tab:brown"}
    fig, (ax, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    x = [r["step"] for r in rows]
    for m in modes:
        ls = "-" if m.endswith("-ef") else "--"
        ax.plot(x, [r[m]["drift"] for r in rows], ls, color=colors.get(m), label=m)
        ax2.plot(x, [r[m]["step_error"] for r in rows], ls, color=colors.get(m), label=m, lw=0.8)
        ax3.plot(x, [r[m]["displacement_drift"] for r in rows], ls, color=colors.get(m), label=m)
    ax.set_yscale("log")
    ax.set_ylabel("||sum of errors|| / ||sum of exact means||")
    ax.set_title(f"{result['task']}, world {result['world']}: compressed all-reduce error along the fp32 trajectory",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax2.set_yscale("log")
    ax2.set_ylabel("per-step relative error")
    ax2.grid(alpha=0.3, which="both")
    ax3.set_yscale("log")
    ax3.set_ylabel("Adam: ||sum lr (u_m - u)|| / ||sum lr u||")
    ax3.set_xlabel("optimizer step")
    ax3.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    a = build_parser().parse_args(argv)
    for name in ("steps", "world"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(a, name)}")
    out = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        mp.spawn(worker, args=(a, os.path.join(tmp, "store"), raw), nprocs=a.world, join=True)
        with open(raw) as f:
            result = json.load(f)
    result.update(task=a.task, world=a.world, seed=a.seed, steps=a.steps, modes=a.modes,
                  wall_time_s=time.perf_counter() - t0, torch_version=torch.__version__,
                  command=" ".join(["python", "studies/measure_error_feedback.py", *(argv if argv is not None
                                                                                     else sys.argv[1:])]))
    rows = result["rows"]
    marks = sorted({min(len(rows), k) for k in (1, 10, 30, 100, 300, 1000, len(rows))})
    summary = {m: {str(k): rows[k - 1][m]["drift"] for k in marks} for m in a.modes}
    for m in a.modes:
        s = summary[m]
        s["displacement_drift"] = {str(k): rows[k - 1][m]["displacement_drift"] for k in marks}
        plain = m[:-3] if m.endswith("-ef") else None
        if plain in a.modes:
            s["final_drift_vs_without_ef"] = rows[-1][m]["drift"] / rows[-1][plain]["drift"]
            s["final_displacement_drift_vs_without_ef"] = (rows[-1][m]["displacement_drift"]
                                                           / rows[-1][plain]["displacement_drift"])
        for key in ("step_error", "update_error", "update_along"):
            s[f"mean_{key}"] = sum(r[m][key] for r in rows) / len(rows)
    result["summary"] = summary
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(out)[0] + ".png"
    plot(result, png)
    print(f"{a.task}, world {a.world}, {result['parameters']} parameters, {a.steps} steps on the fp32 trajectory "
          f"({result['train_time_s']:.0f} s); drift = ||sum of errors|| / ||sum of exact means|| after N steps")
    print(f"{'mode':<14}" + "".join(f"{'N=' + str(k):>11}" for k in marks) + f"{'mean step err':>15}{'drift/no-EF':>13}")
    for m in a.modes:
        s = summary[m]
        ratio = s.get("final_drift_vs_without_ef")
        print(f"{m:<14}" + "".join(f"{s[str(k)]:>11.2e}" for k in marks) + f"{s['mean_step_error']:>15.3e}"
              + (f"{ratio:>13.3f}" if ratio is not None else f"{'—':>13}"))
    print("AdamW's view: displacement drift = ||sum lr (u_m - u)|| / ||sum lr u|| after N steps; update along = "
          "<u_m, u> / ||u||^2, mean over steps")
    print(f"{'mode':<14}" + "".join(f"{'N=' + str(k):>11}" for k in marks)
          + f"{'update err':>12}{'along':>8}{'disp/no-EF':>12}")
    for m in a.modes:
        s = summary[m]
        ratio = s.get("final_displacement_drift_vs_without_ef")
        print(f"{m:<14}" + "".join(f"{s['displacement_drift'][str(k)]:>11.2e}" for k in marks)
              + f"{s['mean_update_error']:>12.3f}{s['mean_update_along']:>8.3f}"
              + (f"{ratio:>12.3f}" if ratio is not None else f"{'—':>12}"))
    print(f"wrote {os.path.relpath(out)} and {os.path.relpath(png)}")
    return result


if __name__ == "__main__":
    main()
