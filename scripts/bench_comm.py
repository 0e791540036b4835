"""Time of one gradient sync per bucket size and mode, across ranks: plain fp32 all-reduce, a bf16
all-reduce (what torch's ``bf16_compress_hook`` does: cast, all-reduce, divide, cast back), FP8
``two_shot`` and FP8 ``nccl_fp8`` (NCCL on sm90+ only), through the same code the hooks run.

Launch with torchrun, one process per GPU (or on CPU with gloo):

    torchrun --standalone --nproc-per-node 8 scripts/bench_comm.py --out benchmarks/results/comm-nvlink
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
        torchrun --standalone --nproc-per-node 8 scripts/bench_comm.py --out benchmarks/results/comm-socket

Each measurement: warm-up, then repeats of (barrier, start event, sync, end event); the time of a
repeat is the maximum over ranks (the sync is done when the slowest rank is), the reported value the
median of those. ``ratio_vs_bf16`` is measured in the same run; ``busbw_gbps`` is the bus bandwidth
of the fp32 payload an all-reduce moves, 2(W-1)/W * bytes / time (as nccl-tests report it).
The NCCL transport variables in effect are recorded in the JSON. Writes ``<out>.json`` and ``<out>.png``.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

SIZES_MB = [1, 4, 25, 100]
NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE",
             "NCCL_ALGO", "NCCL_PROTO")


def _sync_fns(x: torch.Tensor, world: int, on_nccl: bool):
    from fp8_comm_hook import FP8CommConfig, all_reduce

    def plain():
        dist.all_reduce(x)
        x.div_(world)

    xb = torch.empty_like(x, dtype=torch.bfloat16)

    def bf16():
        xb.copy_(x)
        dist.all_reduce(xb)
        xb.div_(world)
        x.copy_(xb)

    two = FP8CommConfig(min_compress_numel=0)
    fns = {"fp32": plain, "bf16": bf16, "fp8_two_shot": lambda: all_reduce(x, two)}
    if on_nccl and torch.cuda.get_device_capability() >= (9, 0):
        nccl = FP8CommConfig(algorithm="nccl_fp8", min_compress_numel=0)
        fns["fp8_nccl_fp8"] = lambda: all_reduce(x, nccl)
    return fns


def _time(fn, reps: int, device: torch.device) -> float:
    ts = []
    cuda = device.type == "cuda"
    for _ in range(reps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            t = a.elapsed_time(b) * 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) * 1e6
        tt = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        ts.append(tt.item())
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=SIZES_MB, help="fp32 bucket sizes in MB")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/comm", help="path stem of the .json and .png")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    W, rank = dist.get_world_size(), dist.get_rank()
    on_nccl = dist.get_backend() == "nccl"
    rows = []
    for mb in a.sizes_mb:
        n = int(mb * 2 ** 20 / 4)
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(n, device=device, generator=g)
        fns = _sync_fns(x, W, on_nccl)
        times = {}
        for name, fn in fns.items():
            for _ in range(a.warmup):
                fn()
            times[name] = _time(fn, a.reps, device)
        for name, us in times.items():
            rows.append(dict(mode=name, size_mb=mb, numel=n, world=W, us=us, ratio_vs_bf16=times["bf16"] / us,
                             busbw_gbps=2 * (W - 1) / W * 4 * n / (us * 1e3)))
    if rank == 0:
        env = {k: os.environ.get(k) for k in NCCL_VARS}
        dev = torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)"
        print(f"gradient sync, world {W}, {dist.get_backend()} on {dev}, env {env}; median of max-over-ranks")
        print(f"{'MB':>6} {'mode':>14} {'us':>10} {'vs bf16':>8} {'busbw GB/s':>11}")
        for r in rows:
            print(f"{r['size_mb']:>6g} {r['mode']:>14} {r['us']:>10.1f} {r['ratio_vs_bf16']:>8.2f} {r['busbw_gbps']:>11.2f}")
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".json", "w") as f:
            json.dump(dict(device=dev, backend=dist.get_backend(), world=W, env=env, torch=torch.__version__,
                           rows=rows), f, indent=1)
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 4))
            for mode in dict.fromkeys(r["mode"] for r in rows):
                rr = [r for r in rows if r["mode"] == mode]
                ax.plot([r["size_mb"] for r in rr], [r["ratio_vs_bf16"] for r in rr], "o-", label=mode)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log")
            ax.set_xlabel("bucket size (MB of fp32)")
            ax.set_ylabel("speed-up vs bf16 all-reduce")
            ax.set_title(f"world {W}, {dist.get_backend()}, {dev}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(a.out + ".png", dpi=110)
        except ImportError:
            print("matplotlib missing: no PNG", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
