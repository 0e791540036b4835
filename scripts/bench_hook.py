"""Per-bucket cost of the FP8 path against a plain all-reduce, by bucket size: the measurement
behind the default ``min_compress_numel``.

Spawns a gloo world (CPU tensors by default, ``--device cuda`` for CUDA tensors through gloo) and
times, for each bucket size, one averaged all-reduce of an fp32 bucket: plain (SUM all-reduce +
divide) and FP8 ``two_shot`` (``fp8_comm_hook.all_reduce``, the hook's code path); also the codec
alone (encode + reduce_shard + decode, no collectives). Median over repeats, ranks synchronised by a
barrier before each repeat. The extra fixed cost of FP8 at small sizes, against the bytes it saves,
gives the size above which FP8 pays on a link of a given bandwidth:

    n* = (t_fp8(n) - t_plain(n)) measured at small n  /  (saved bytes per element / link bandwidth)

Writes JSON and a PNG (``--out``), prints a table.

    python scripts/bench_hook.py --world 2 --out benchmarks/results/hook-cpu-gloo
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

SIZES = [1024, 4096, 16384, 65536, 262144, 1048576, 4194304]


def _time(fn, reps):
    ts = []
    for _ in range(reps):
        dist.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _worker(rank, world, store_path, device, reps, out_path):
    torch.set_num_threads(1)
    from fp8_comm_hook import FP8CommConfig, all_reduce
    from fp8_comm_hook.codec import TorchCodec, get_codec
    from fp8_comm_hook.formats import get_format
    from fp8_comm_hook.layout import BucketLayout

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    cfg = FP8CommConfig(min_compress_numel=0)
    rows = []
    for n in SIZES:
        x = torch.randn(n, device=device)
        r = max(5, min(reps, int(reps * 65536 / n)))

        def plain():
            dist.all_reduce(x)
            x.div_(world)

        def fp8():
            all_reduce(x, cfg)

        plain()
        fp8()  # warm-up: builds the layout
        t_plain, t_fp8 = _time(plain, r), _time(fp8, r)
        L = BucketLayout([n], [0], ["b"], world, rank, cfg.block_size, cfg.scaling, n, x.dtype, x.device)
        codec = get_codec(cfg, x.device)
        L.recv.copy_(L.send)

        def codec_only():
            codec.encode(x, L)
            codec.reduce_shard(L)
            codec.decode(L, x)

        codec_only()
        t_codec = _time(codec_only, r)
        rows.append(dict(numel=n, bytes_fp32=4 * n, plain_us=t_plain, fp8_us=t_fp8, codec_us=t_codec,
                         world=world, device=str(device), backend=codec.name, repeats=r))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def wins_from(rows, wins):
    """Smallest measured size from which ``wins(row)`` holds at that size and every larger one (a
    single size that wins among losing neighbours is noise, not a crossover); None if none."""
    best = None
    for r in sorted(rows, key=lambda r: r["numel"], reverse=True):
        if not wins(r):
            break
        best = r["numel"]
    return best


def crossover(rows, world, link_gbps):
    """Smallest measured size from which FP8 on a link of ``link_gbps`` GB/s beats fp32 (at every
    larger size too), from the measured times at loopback plus the wire time (2(W-1)/W bytes per
    element, 4 vs ~1.03); ``link_gbps`` None: the measured times alone."""
    ring = 2 * (world - 1) / world

    def wins(r):
        if link_gbps is None:   # on loopback the wire is ~free: the measured times are all there is
            return r["fp8_us"] < r["plain_us"]
        wire_fp32 = ring * 4 * r["numel"] / (link_gbps * 1e3)          # us
        wire_fp8 = ring * (1 + 4 / 128) * r["numel"] / (link_gbps * 1e3)
        return r["fp8_us"] + wire_fp8 < r["plain_us"] + wire_fp32

    return wins_from(rows, wins)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out", default="benchmarks/results/hook-cpu-gloo", help="path stem for .json and .png")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = os.path.join(d, "rows.json")
        mp.spawn(_worker, args=(a.world, os.path.join(d, "store"), a.device, a.reps, tmp), nprocs=a.world)
        rows = json.load(open(tmp))
    links = {"loopback (measured)": None, "100 GbE (12.5 GB/s)": 12.5, "25 GbE (3.1 GB/s)": 3.125}
    summary = {k: crossover(rows, a.world, v) for k, v in links.items()}
    host = f"{torch.__version__}, {os.cpu_count()} CPUs" + (f", {torch.cuda.get_device_name()}" if a.device == "cuda" else "")
    print(f"per-bucket averaged all-reduce, gloo world {a.world} on {a.device} ({host}); median us")
    print(f"{'numel':>9} {'plain_us':>10} {'fp8_us':>10} {'codec_us':>10} {'fp8/plain':>9}")
    for r in rows:
        print(f"{r['numel']:>9} {r['plain_us']:>10.1f} {r['fp8_us']:>10.1f} {r['codec_us']:>10.1f} {r['fp8_us'] / r['plain_us']:>9.2f}")
    print("smallest size from which FP8 wins:", summary)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"host": host, "world": a.world, "device": a.device, "rows": rows, "fp8_wins_from_numel": summary}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    n = [r["numel"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(n, [r["plain_us"] for r in rows], "o-", label="plain fp32 all-reduce")
    ax.loglog(n, [r["fp8_us"] for r in rows], "s-", label="fp8 two_shot")
    ax.loglog(n, [r["codec_us"] for r in rows], "^--", label="fp8 codec only")
    ax.set_xlabel("bucket elements (fp32)")
    ax.set_ylabel("median time per bucket (us)")
    ax.set_title(f"gloo world {a.world}, {a.device}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
