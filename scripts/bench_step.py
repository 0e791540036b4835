"""DDP training-step time with each gradient communication, side by side in one run: what the FP8 hook
costs a step where the wire is not the bottleneck.

For every parameter dtype (fp32, bf16) and mode, one DDP model of ``--layers`` Linear(width, width)
layers (20 x 4096 x 4096 + bias = 335.6M parameters by default) trains ``--steps`` SGD steps on a
fixed batch after ``--warmup`` steps, the modes' steps interleaved; reported per row:

- ``step_ms``: median wall time of forward + backward + optimizer step, the device synchronised at
  both ends of each step;
- ``backward_host_ms``: median host time inside ``loss.backward()`` (not waiting for the device);
- ``host_us_per_bucket``: median over steps of the host time spent inside the comm hook (its Future
  callbacks included when they run inline, as NCCL's do) divided by the buckets of the step (None
  for DDP's built-in fp32 all-reduce, which has no Python hook);
- ``buckets``: hook calls per step;
- ``ddp_native_all_reduce``: auto registered no hook (it predicted the plain all-reduce fastest for
  every bucket the model can form, as ``register_ddp_hook`` then does) and DDP's own all-reduce ran;
- ``auto_plan`` (auto only): the figures auto measured, its break-even sizes and each bucket size's
  choice with the predicted times (``AutoPlan.report()``).

Modes: ``fp32`` (DDP's own all-reduce), ``bf16`` (torch's ``bf16_compress_hook`` on NCCL, the same
recipe from :mod:`fp8_comm_hook.cast_hook` elsewhere), ``fp8`` with ``algorithm`` two_shot, nccl_fp8
(only on NCCL with an sm90+ GPU) and auto (measured as ``register_ddp_hook`` does). Every mode runs the full multi-rank code path:
the package has no world-1 shortcut.

World 1 over NCCL (the default) measures the fixed cost of each hook; ``--world N --backend gloo
--device cuda`` runs the same with N ranks sharing one GPU through gloo, as a check that nothing
depends on world 1. Writes ``<out>.json`` ({"rows": [...], "device", "torch", ...}) and ``<out>.png``.

    python scripts/bench_step.py --out benchmarks/results/step-h200
    python scripts/bench_step.py --world 2 --backend gloo --device cuda --out /tmp/step-gloo
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the spawned ranks import the package from the checkout
    sys.path.insert(0, ROOT)
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")

MODES = [("fp32", None), ("bf16", None), ("fp8", "two_shot"), ("fp8", "nccl_fp8"), ("fp8", "auto")]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HookTimer:
    """Wraps a DDP comm hook, adding the host time spent inside it to ``total`` and counting calls."""

    def __init__(self, hook):
        self.hook, self.total, self.calls = hook, 0.0, 0

    def make(self):
        timer = self

        def timed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            t0 = time.perf_counter()
            try:
                return timer.hook(state, bucket)
            finally:
                timer.total += time.perf_counter() - t0
                timer.calls += 1

        return timed_hook


def _model(layers: int, width: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).to(device=device, dtype=dtype)


def _register(model, mode, algorithm, backend, bucket_state_cfg):
    """Register the mode's hook behind a timer; returns (timer, FP8CommState); the timer is None
    where DDP's own all-reduce runs (fp32, or auto that registered no hook), the state None
    for fp32 and bf16."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from fp8_comm_hook import FP8CommState, fp8_hook
    from fp8_comm_hook.cast_hook import bf16_allreduce_hook

    pg = model.process_group
    if mode == "fp32":
        return None, None
    if mode == "bf16":
        timer = _HookTimer(default_hooks.bf16_compress_hook if backend == "nccl" else bf16_allreduce_hook)
        model.register_comm_hook(pg, timer.make())
        return timer, None
    state = FP8CommState(bucket_state_cfg.replace(algorithm=algorithm), pg).bind(model)
    # register_ddp_hook's set-up, with the hook wrapped in the timer: the gloo communication worker ...
    from fp8_comm_hook.ddp import _plan_auto, _start_worker
    _start_worker(state, pg, next(model.parameters()).device)
    # what register_ddp_hook does: measure the group and the codec, choose per bucket, and register no
    # hook where every bucket would go plain (DDP's own all-reduce then runs, as for fp32)
    if algorithm == "auto" and _plan_auto(state, model):
        return None, state
    timer = _HookTimer(fp8_hook)
    model.register_comm_hook(state, timer.make())
    return timer, state


class _Run:
    """One mode's DDP model, optimizer, batch and measurements."""

    def __init__(self, args, rank, device, param_dtype, mode, algorithm):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from fp8_comm_hook import FP8CommConfig

        self.mode, self.algorithm, self.param_dtype, self.device = mode, algorithm, param_dtype, device
        self.net = _model(args.layers, args.width, param_dtype, device)
        self.numel = sum(p.numel() for p in self.net.parameters())
        self.ddp = DDP(self.net, device_ids=[device.index] if device.type == "cuda" else None,
                       bucket_cap_mb=args.bucket_mb)
        self.timer, self.state = _register(self.ddp, mode, algorithm, args.backend, FP8CommConfig(backend=args.codec))
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-6)
        g = torch.Generator(device="cpu").manual_seed(rank)
        self.x = torch.randn(args.batch, args.width, generator=g).to(device=device, dtype=param_dtype)
        self.steps, self.backward_host, self.hook_us, self.buckets = [], [], [], 0
        self.prof = None
        if args.profile and rank == 0 and (algorithm or mode) in args.profile and param_dtype == torch.float32:
            import cProfile
            self.prof = cProfile.Profile()

    def step(self, record: bool) -> None:
        """One synchronised training step; its times are kept when ``record``."""
        dist.barrier()
        _sync(self.device)
        timer = self.timer
        h0, n0 = (timer.total, timer.calls) if timer else (0.0, 0)
        if self.prof is not None and record:
            self.prof.enable()
        t0 = time.perf_counter()
        loss = self.ddp(self.x).float().square().mean()
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        _sync(self.device)
        t1 = time.perf_counter()
        if self.prof is not None and record:
            self.prof.disable()
        if record:
            self.steps.append((t1 - t0) * 1e3)
            self.backward_host.append((b1 - b0) * 1e3)
            if timer:
                self.buckets = timer.calls - n0
                self.hook_us.append((timer.total - h0) * 1e6 / max(self.buckets, 1))

    def row(self) -> dict:
        if self.prof is not None:
            import pstats
            print(f"--- cProfile of the measured steps, {self.algorithm or self.mode}, fp32 parameters (rank 0), "
                  "by own time")
            pstats.Stats(self.prof).sort_stats("tottime").print_stats(28)
        return dict(mode=self.mode, algorithm=self.algorithm, param_dtype=str(self.param_dtype).replace("torch.", ""),
                    numel=self.numel, buckets=self.buckets if self.timer else None,
                    step_ms=statistics.median(self.steps), backward_host_ms=statistics.median(self.backward_host),
                    host_us_per_bucket=statistics.median(self.hook_us) if self.hook_us else None,
                    ddp_native_all_reduce=self.state is not None and self.state.ddp_native_all_reduce,
                    auto_plan=self.state.auto_plan.report() if self.algorithm == "auto" else None)


def _run_dtype(args, rank, device, param_dtype, modes):
    """Every mode of one parameter dtype, side by side: the models are built together and their
    steps interleaved (mode 1, mode 2, ..., mode 1, ...), so slow drifts of the machine (clocks,
    temperature, other tenants) fall on every mode alike."""
    runs = [_Run(args, rank, device, param_dtype, mode, algorithm) for mode, algorithm in modes]
    for i in range(args.warmup + args.steps):
        for run in runs:
            run.step(record=i >= args.warmup)
    rows = [run.row() for run in runs]
    del runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _worker(rank, args, store_path, out_path):
    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, store=dist.FileStore(store_path, args.world), rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=600),
                            **({"device_id": device} if args.backend == "nccl" else {}))
    rows = []
    nccl_fp8_ok = (args.backend == "nccl" and device.type == "cuda"
                   and torch.cuda.get_device_capability(device) >= (9, 0))
    for dtype in (torch.float32, torch.bfloat16):
        modes = [(m, a) for m, a in MODES if not (a == "nccl_fp8" and not nccl_fp8_ok)
                 and not (args.modes and (a or m) not in args.modes)]
        for r in _run_dtype(args, rank, device, dtype, modes):
            rows.append(r)
            if rank == 0:
                us = "-" if r["host_us_per_bucket"] is None else f"{r['host_us_per_bucket']:.0f} us"
                print(f"  {r['param_dtype']:9s} {(r['algorithm'] or r['mode']):9s} step {r['step_ms']:7.2f} ms  "
                      f"backward host {r['backward_host_ms']:7.2f} ms  hook {us} x {r['buckets']}", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _table(rows):
    lines = ["| param dtype | mode | step (ms) | vs bf16 hook | backward host (ms) | hook host (us/bucket) | buckets |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b["step_ms"] for b in rows if b["param_dtype"] == r["param_dtype"] and b["mode"] == "bf16"), None)
        ratio = f"{r['step_ms'] / base:.2f}x" if base else "-"
        us = "-" if r["host_us_per_bucket"] is None else f"{r['host_us_per_bucket']:.0f}"
        name = r["mode"] if r["algorithm"] is None else f"fp8 {r['algorithm']}"
        if r.get("ddp_native_all_reduce"):
            name += " (DDP's own all-reduce)"
        lines.append(f"| {r['param_dtype']} | {name} | {r['step_ms']:.2f} | {ratio} | {r['backward_host_ms']:.2f} | "
                     f"{us} | {r['buckets'] if r['buckets'] is not None else '-'} |")
    return "\n".join(lines)


def _plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["param_dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        sub = [r for r in rows if r["param_dtype"] == dt]
        names = [r["mode"] if r["algorithm"] is None else f"fp8\n{r['algorithm']}" for r in sub]
        ax.bar(names, [r["step_ms"] for r in sub], color=["#888", "#4a7", "#c54", "#d93", "#57b"][:len(sub)])
        ax.bar(names, [r["backward_host_ms"] for r in sub], width=0.3, color="k", alpha=0.35,
               label="host time in backward")
        ax.set_title(f"{dt} parameters")
        ax.set_ylabel("median step (ms)")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=40,
                   help="steps before measuring: nccl_fp8's automatic pre_scale cycles through 16 values at world 1, "
                        "and each gets its CUDA graph the second time it comes round")
    p.add_argument("--codec", default="auto", choices=["auto", "torch", "triton", "te"],
                   help="FP8CommConfig.backend of the fp8 rows")
    p.add_argument("--modes", nargs="*", default=None,
                   help="run only these (fp32 bf16 two_shot nccl_fp8 auto); default all that can run here")
    p.add_argument("--profile", nargs="*", default=None,
                   help="print a cProfile of the measured steps of these modes (fp32 parameters, rank 0)")
    p.add_argument("--out", default="benchmarks/results/step-h200")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    if args.backend == "nccl" and args.device != "cuda":
        raise ValueError("--backend nccl needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU; use --device cpu --backend gloo")
    if args.backend == "nccl" and args.world > 1 and torch.cuda.device_count() < args.world:
        raise ValueError(f"--backend nccl at --world {args.world} needs {args.world} GPUs (NCCL refuses ranks "
                         "sharing one); use --backend gloo for ranks sharing a GPU")
    with tempfile.TemporaryDirectory() as tmp:
        store, res = os.path.join(tmp, "store"), os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(args, store, res), nprocs=args.world, join=True)
        with open(res) as f:
            rows = json.load(f)
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    meta = dict(device=dev, torch=torch.__version__, world=args.world, backend=args.backend,
                tensor_device=args.device, layers=args.layers, width=args.width, batch=args.batch,
                bucket_mb=args.bucket_mb, steps=args.steps, warmup=args.warmup, codec=args.codec,
                command="python scripts/bench_step.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    title = (f"DDP step, {rows[0]['numel'] / 1e6:.1f}M parameters, world {args.world} over {args.backend} "
             f"({args.device} tensors), {args.bucket_mb:g} MB buckets, {dev}")
    print(title)
    print(_table(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": rows, **meta}, f, indent=1)
    _plot(rows, args.out + ".png", title)
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
