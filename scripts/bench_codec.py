#!/usr/bin/env python
"""Codec throughput on one GPU, per backend x scaling mode x op, against the copy ceiling.

Ops (the three stages of two_shot, on a bucket of several parameters, world W; ``--buckets``: "aligned"
parameter sizes, multiples of the block size as in real models, read as one contiguous run, and
"odd" sizes, read through the segment table at unaligned addresses, the worst case):
  quantize              = codec.encode(flat, layout)       (the bucket -> packed send buffer)
  dequant_sum_requant   = codec.reduce_shard(layout)       (W received chunks -> fp32 mean -> packed shard)
  dequantize            = codec.decode(layout, flat)       (W gathered shards -> the bucket)

Time: GPU time. After warm-up the op's calls are captured into a CUDA graph (one call per rotating
bucket) and the graph's replays are timed with CUDA events; the median replay over the number of
calls in it is one call's GPU time, without the host's launch cost (``timing: "graph"`` in a row;
an op that cannot be captured is timed as eager calls between events, ``timing: "events"``). When an
op's working set is small enough to stay in L2, calls rotate over several independent
buckets/layouts so every call reads cold memory.

Bytes counted (the minimum traffic of the op, every byte moved once; effective GB/s = bytes / time):
  quantize:             numel * input_bytes            + W * chunk_bytes
  dequant_sum_requant:  W * chunk_bytes                + chunk_bytes
  dequantize:           W * chunk_bytes                + numel * output_bytes
where chunk_bytes = chunk_numel (FP8 payload) + 4 * scales_per_chunk. A backend that passes over the
data twice (amax, then cast) or stages through fp32 moves more than it is credited with, so its GB/s
is lower: the number compares backends against the device-to-device copy ceiling, measured in the same
run as copy_gbps = 2 * bytes / time of ``dst.copy_(src)`` on a 1 GiB buffer.

hook_cpu_overhead: host time of one DDP-hook-equivalent call (``state.prepare`` + the reduce path
+ the finishing decode) on a one-rank NCCL group (collectives degenerate at world 1), median over calls,
with the device synchronised between calls so that only the host's issue cost is timed.

Writes ``<out-dir>/<name>.json`` (a list of rows: backend, op, scaling, fp8_format, dtype, numel, world,
us, gbps, copy_gbps) and ``<out-dir>/<name>.png`` (needs matplotlib; ``--plot-only JSON`` renders the
plot from a JSON written elsewhere), and prints a table.
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_SIZES = [1 << 20, 6_553_600, 1 << 26, 1 << 29]
QUICK_SIZES = [1 << 20, 6_553_600]
OPS = ("quantize", "dequant_sum_requant", "dequantize")
SCALINGS = ("block", "tensor", "bucket")
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def parse_size(text: str) -> int:
    """'1M' -> 1048576, '6.55M' -> 6553600, '64M', '512M', '1G', or a plain integer."""
    t = text.strip().upper()
    if t == "6.55M":
        return 6_553_600
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    return int(float(num) * mult)


def split_bucket(numel: int, aligned: bool = False, block_size: int = 128):
    """Parameter sizes of a bucket of ``numel`` elements: a few large parameters and small ones, as
    in a real model's bucket. Odd sizes by default (every parameter but the first starts at an
    unaligned address and ends in a padded block: the segment-table path, the worst case); with
    ``aligned`` every size is a multiple of ``block_size`` (as the matrices and vectors of real
    models are), so the bucket is one contiguous run of blocks (the codec's contiguous path)."""
    if numel < 64:
        return [numel]
    parts = []
    left = numel
    for frac in (0.40, 0.20, 0.15, 0.10, 0.07, 0.05, 0.02):
        p = max(1, int(numel * frac)) | 1
        if p >= left:
            break
        parts.append(p)
        left -= p
    parts.append(left)
    parts = [p for p in parts if p > 0]
    if aligned:
        parts = [max(block_size, (p // block_size) * block_size) for p in parts]
    return parts


# ---------------------------------------------------------------------------------------- timing
def time_calls(fns, budget_s: float, min_reps: int = 5, max_reps: int = 100, warmup: int = 3):
    """Median device milliseconds of one call, rotating over the callables ``fns``."""
    import torch
    for i in range(warmup):
        fns[i % len(fns)]()
    return _event_median_ms(lambda i: fns[i % len(fns)](), budget_s, min_reps, max_reps)


def _event_median_ms(call, budget_s: float, min_reps: int, max_reps: int) -> float:
    """Median CUDA-event milliseconds of ``call(i)`` over as many repeats as ``budget_s`` allows (one
    timed call estimates the count), between ``min_reps`` and ``max_reps``."""
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call(0)
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(min_reps, budget_s / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        call(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graph_time_ms(fns, budget_s: float, min_reps: int = 5, max_reps: int = 200) -> float:
    """Median device milliseconds of one call: the calls ``fns`` (rotating buckets) are captured
    once into a CUDA graph, whose replays are timed with CUDA events; the time of one replay over
    ``len(fns)`` is the GPU time of one call without the host's launch cost in it."""
    import torch
    for f in fns:
        f()
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(2):
        g.replay()
    ms = _event_median_ms(lambda i: g.replay(), budget_s, min_reps, max_reps) / len(fns)
    del g
    return ms


def copy_bandwidth_gbps(budget_s: float) -> float:
    """Device-to-device copy bandwidth (read + write) on a 1 GiB buffer."""
    import torch
    n = 1 << 28
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_calls([lambda: dst.copy_(src)], budget_s, min_reps=10, max_reps=50)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def l2_bytes() -> int:
    """L2 cache size of GPU 0 (50 MiB when torch does not report it)."""
    import torch
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2 ** 20)


# ---------------------------------------------------------------------------------------- codec ops
def available_backends():
    """Backends that run here, in order: torch, triton, te."""
    from fp8_comm_hook.codec.select import te_available, triton_available
    out = ["torch"]
    if triton_available():
        out.append("triton")
    if te_available():
        out.append("te")
    return out


def make_codec(backend: str, fmt_name: str):
    """A codec of ``backend`` for FP8 format ``fmt_name``."""
    from fp8_comm_hook.formats import get_format
    fmt = get_format(fmt_name)
    if backend == "torch":
        from fp8_comm_hook.codec.torch_codec import TorchCodec
        return TorchCodec(fmt)
    if backend == "triton":
        from fp8_comm_hook.codec.triton_codec import TritonCodec
        return TritonCodec(fmt)
    from fp8_comm_hook.codec.te_codec import TECodec
    return TECodec(fmt)


def make_set(numel: int, dtype, scaling: str, world: int, block_size: int, bucket: str = "odd"):
    """One bucket (flat tensor) and its layout, with send/recv/gather buffers holding real bytes;
    ``bucket``: "odd" or "aligned" parameter sizes (:func:`split_bucket`)."""
    import torch
    from fp8_comm_hook.codec.torch_codec import TorchCodec
    from fp8_comm_hook.formats import get_format
    from fp8_comm_hook.layout import BucketLayout
    numels = split_bucket(numel, aligned=bucket == "aligned", block_size=block_size)
    offs, o = [], 0
    for n in numels:
        offs.append(o)
        o += n
    L = BucketLayout(numels, offs, [f"p{i}" for i in range(len(numels))], world, 0, block_size, scaling, o,
                     dtype, "cuda")
    flat = torch.randn(o, device="cuda").to(dtype)
    TorchCodec(get_format("e4m3")).encode(flat, L)
    L.recv.copy_(L.send)
    L.gather_out.copy_(L.send)
    return flat, L


def op_bytes(op: str, L, numel: int, esize: int) -> int:
    """The byte count of the module docstring's formula."""
    W, cb = L.world_size, L.chunk_bytes
    if op == "quantize":
        return numel * esize + W * cb
    if op == "dequant_sum_requant":
        return W * cb + cb
    return W * cb + numel * esize


def op_call(codec, op: str, flat, L):
    """A no-argument callable running ``op`` once."""
    if op == "quantize":
        return lambda: codec.encode(flat, L)
    if op == "dequant_sum_requant":
        return lambda: codec.reduce_shard(L)
    return lambda: codec.decode(L, flat)


def bench_codecs(args, copy_gbps: float, rows: list) -> None:
    """Time every available backend x scaling x op x size x dtype; append rows."""
    import torch
    backends = [b for b in available_backends() if b in args.backends]
    print(f"backends: {backends} (requested {args.backends})", flush=True)
    l2 = l2_bytes()
    for numel, bucket in [(n, b) for n in args.sizes for b in args.buckets]:
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            esize = torch.empty(0, dtype=dtype).element_size()
            for scaling in args.scalings:
                for fmt_name in args.formats:
                    target = args.rotate_factor * l2
                    try:
                        sets = [make_set(numel, dtype, scaling, args.world, args.block_size, bucket)]
                        small = min(op_bytes(op, sets[0][1], numel, esize) for op in args.ops)
                        want = 1 if small >= target else min(args.max_rotate, math.ceil(target / small))
                        while len(sets) < want:
                            sets.append(make_set(numel, dtype, scaling, args.world, args.block_size, bucket))
                    except torch.cuda.OutOfMemoryError as e:
                        print(f"skip numel={numel} {dname} {scaling}: out of memory ({e})", flush=True)
                        sets = []
                        torch.cuda.empty_cache()
                        continue
                    for backend in backends:
                        if backend == "te" and scaling == "block":
                            continue
                        codec = make_codec(backend, fmt_name)
                        for op in args.ops:
                            nbytes = op_bytes(op, sets[0][1], numel, esize)
                            k = 1 if nbytes >= target else min(len(sets), math.ceil(target / nbytes))
                            fns = [op_call(codec, op, f, L) for f, L in sets[:k]]
                            timing = "graph"
                            try:
                                ms = graph_time_ms(fns, args.budget)
                            except Exception as e:  # not capturable: time the eager calls instead
                                print(f"no graph for {backend} {op} {scaling} {dname} {numel} ({e!r}): "
                                      "timing eager calls", flush=True)
                                torch.cuda.synchronize()
                                timing = "events"
                                try:
                                    ms = time_calls(fns, args.budget, warmup=max(3, k))
                                except Exception as e2:  # keep going: one broken combination must not end the run
                                    print(f"FAILED {backend} {op} {scaling} {dname} {numel}: {e2!r}", flush=True)
                                    continue
                            row = dict(backend=backend, op=op, scaling=scaling, fp8_format=fmt_name, dtype=dname,
                                       numel=numel, bucket=bucket, world=args.world, us=ms * 1e3,
                                       gbps=nbytes / (ms * 1e-3) / 1e9, copy_gbps=copy_gbps, timing=timing)
                            rows.append(row)
                            print(fmt_row(row) + (f" (rotating {k})" if k > 1 else ""), flush=True)
                    del sets
                    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- hook overhead
def bench_hook_overhead(args, copy_gbps: float, rows: list) -> None:
    """Host microseconds of one hook-equivalent call on a one-rank NCCL group."""
    import torch
    import torch.distributed as dist
    from fp8_comm_hook import FP8CommConfig, FP8CommState
    from fp8_comm_hook.reduce import reduce_flat
    own_pg = False
    tmp = None
    try:
        if not dist.is_initialized():
            torch.cuda.set_device(0)
            tmp = tempfile.mkdtemp()
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1)
            own_pg = True
    except Exception as e:
        print(f"hook_cpu_overhead skipped: cannot start a one-rank NCCL group ({e!r})", flush=True)
        return
    try:
        numel = args.hook_numel
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            flat = torch.randn(numel, device="cuda").to(dtype)
            numels = split_bucket(numel)
            grads, o = [], 0
            for n in numels:
                grads.append(flat[o:o + n])
                o += n
            combos = [(b, s) for b in available_backends() if b in args.backends for s in args.scalings
                      if not (b == "te" and s == "block")]
            combos.append(("none", "block"))
            for backend, scaling in combos:
                if backend == "none":
                    cfg = FP8CommConfig(algorithm="none")
                else:
                    cfg = FP8CommConfig(backend=backend, scaling=scaling, fp8_format=args.formats[0],
                                        min_compress_numel=0)
                state = FP8CommState(cfg)

                def call():
                    work, finish = reduce_flat(state, flat, state.bucket_spec(grads, grads, flat),
                                               async_op=True)
                    finish()
                    state.end_bucket(True)

                try:
                    for _ in range(5):
                        call()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(args.hook_reps):
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                        torch.cuda.synchronize()
                except Exception as e:  # keep going: one broken combination must not end the run
                    print(f"FAILED hook_cpu_overhead {backend} {scaling} {dname}: {e!r}", flush=True)
                    continue
                row = dict(backend=backend, op="hook_cpu_overhead", scaling=scaling if backend != "none" else "none",
                           fp8_format=args.formats[0], dtype=dname, numel=numel, world=1,
                           us=statistics.median(times) * 1e6, gbps=None, copy_gbps=copy_gbps)
                rows.append(row)
                print(fmt_row(row), flush=True)
    finally:
        if own_pg:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- output
def fmt_row(r: dict) -> str:
    """One row as a table line."""
    g = "" if r.get("gbps") is None else f"{r['gbps']:9.1f} GB/s {100 * r['gbps'] / r['copy_gbps']:5.1f}% of copy"
    return (f"{r['backend']:>6} {r['op']:>20} {r['scaling']:>6} {r['fp8_format']} {r['dtype']:>8} "
            f"{r['numel']:>11,d} {r.get('bucket', 'odd'):>7} W={r['world']} {r['us']:11.1f} us {g}")


def print_table(rows) -> None:
    """All rows, sorted by op, dtype, size, scaling and backend."""
    print("\n" + "-" * 110)
    print(f"{'backend':>6} {'op':>20} {'scale':>6} fmt  {'dtype':>8} {'numel':>11} {'bucket':>7} world "
          f"{'time':>11}    effective")
    for r in sorted(rows, key=lambda r: (r["op"], r["dtype"], r["numel"], r.get("bucket", "odd"), r["scaling"],
                                         r["backend"])):
        print(fmt_row(r))
    print("-" * 110)


def plot(rows, path: str) -> bool:
    """GB/s against bucket size per backend and scaling, one panel per op and dtype, with the copy
    ceiling drawn. Returns False (with a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no PNG: matplotlib is not available ({e!r}); render later with --plot-only JSON", flush=True)
        return False
    data = [r for r in rows if r.get("gbps") is not None]
    if not data:
        print("no PNG: no throughput rows", flush=True)
        return False
    ops = [o for o in OPS if any(r["op"] == o for r in data)]
    dtypes = sorted({r["dtype"] for r in data}, key=lambda d: d != "float32")
    fig, axes = plt.subplots(len(ops), len(dtypes), figsize=(6.5 * len(dtypes), 3.8 * len(ops)), squeeze=False)
    colors = {"torch": "tab:blue", "triton": "tab:red", "te": "tab:green"}
    styles = {"block": "-", "tensor": "--", "bucket": ":"}
    markers = {"odd": "o", "aligned": "s"}
    copy = max(r["copy_gbps"] for r in data)
    for i, op in enumerate(ops):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            sel = [r for r in data if r["op"] == op and r["dtype"] == dt]
            for b in sorted({r["backend"] for r in sel}):
                for s in SCALINGS:
                    for shape in markers:
                        pts = sorted((r["numel"], r["gbps"]) for r in sel if r["backend"] == b and r["scaling"] == s
                                     and r.get("bucket", "odd") == shape)
                        if pts:
                            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[s], marker=markers[shape],
                                    ms=3, color=colors.get(b, "black"), label=f"{b} {s} {shape}",
                                    alpha=1.0 if shape == "aligned" else 0.55)
            ax.axhline(copy, color="gray", ls="-.", lw=1, label=f"copy ceiling {copy:.0f} GB/s")
            ax.set_xscale("log")
            ax.set_title(f"{op} ({dt} bucket)")
            ax.set_xlabel("bucket elements")
            ax.set_ylabel("effective GB/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return True


def main(argv=None):
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")], default=None,
                   help="comma-separated bucket sizes in elements (1M, 6.55M, 64M, 512M, or integers)")
    p.add_argument("--quick", action="store_true", help="small sizes and a short time budget")
    p.add_argument("--dtypes", default="float32,bfloat16", help="bucket dtypes (float32, bfloat16)")
    p.add_argument("--backends", default="torch,triton,te", help="backends to try (those that import)")
    p.add_argument("--scalings", default=",".join(SCALINGS))
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--formats", default="e4m3", help="FP8 formats (e4m3, e5m2)")
    p.add_argument("--world", type=int, default=8, help="world size of the layouts (W chunks)")
    p.add_argument("--buckets", default="aligned,odd",
                   help="bucket shapes: aligned (parameter sizes multiples of the block size: one contiguous run, "
                        "as in real models), odd (odd sizes: the segment-table path, the worst case)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--budget", type=float, default=None, help="seconds of timed calls per measurement")
    p.add_argument("--rotate-factor", type=float, default=4.0,
                   help="rotate over enough buckets that their working sets exceed this many L2 sizes")
    p.add_argument("--max-rotate", type=int, default=64, help="most buckets to rotate over")
    p.add_argument("--hook-numel", type=int, default=6_553_600, help="bucket size of hook_cpu_overhead")
    p.add_argument("--hook-reps", type=int, default=50)
    p.add_argument("--no-hook", action="store_true", help="skip hook_cpu_overhead")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--name", default="codec-h200", help="file name stem of the JSON and PNG")
    p.add_argument("--plot-only", metavar="JSON", help="only render the PNG (and table) from this JSON")
    args = p.parse_args(argv)

    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, args.name + ".png")
    if args.plot_only:
        with open(args.plot_only) as f:
            rows = json.load(f)
        print_table(rows)
        plot(rows, png)
        return 0

    import torch
    if not torch.cuda.is_available():
        print("bench_codec needs a CUDA GPU", file=sys.stderr)
        return 2
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.budget = args.budget if args.budget is not None else (0.02 if args.quick else 0.05)
    args.dtypes = [DTYPE_NAMES[d.strip()] for d in args.dtypes.split(",")]
    args.backends = [b.strip() for b in args.backends.split(",")]
    args.scalings = [s.strip() for s in args.scalings.split(",")]
    args.ops = [o.strip() for o in args.ops.split(",")]
    args.formats = [f.strip() for f in args.formats.split(",")]
    args.buckets = [b.strip() for b in args.buckets.split(",")]
    bad = [b for b in args.buckets if b not in ("aligned", "odd")]
    if bad:
        raise ValueError(f"--buckets: {bad} not allowed; allowed values: aligned, odd")
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    try:
        import triton
        print(f"triton {triton.__version__}", flush=True)
    except Exception:
        pass
    t0 = time.perf_counter()
    copy_gbps = copy_bandwidth_gbps(args.budget * 2)
    print(f"copy ceiling: {copy_gbps:.1f} GB/s (2 * bytes / time of a 1 GiB dst.copy_(src))", flush=True)
    rows = []
    json_path = os.path.join(args.out_dir, args.name + ".json")
    try:
        bench_codecs(args, copy_gbps, rows)
        if not args.no_hook:
            bench_hook_overhead(args, copy_gbps, rows)
    finally:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {json_path} ({len(rows)} rows) after {time.perf_counter() - t0:.0f} s", flush=True)
    print_table(rows)
    plot(rows, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
