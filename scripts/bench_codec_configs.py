#!/usr/bin/env python
"""Launch configurations of the Triton codec's kernels, side by side on one GPU.

For each op and bucket this times the kernels under several launch configurations in the same run
(for the segment-table encode and decode of odd buckets: elements, warps and lanes per program, one
launch per alignment class of blocks; for
the reduce: the payload alignment promised, received chunks in flight, elements and warps per
program), checks that every configuration writes the torch reference's bytes, and prints each one's
GPU time and fraction of the copy ceiling beside the codec's current default. It is how the launch
constants in ``fp8_comm_hook/codec/triton_kernels.py`` were chosen; rerun it on a new GPU before
changing them.

    python scripts/bench_codec_configs.py --out benchmarks/results/codec-configs-h200

Ops, bytes and timing are those of ``scripts/bench_codec.py`` (GPU time of CUDA-graph replays,
rotating buckets where a working set fits in L2, E4M3, W = 8). Writes ``<out>.json`` (rows: op,
dtype, bucket, scaling, numel, config, us, gbps, copy_gbps, default) and ``<out>.png``.
"""
import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_codec import (copy_bandwidth_gbps, graph_time_ms, l2_bytes, make_codec, make_set,  # noqa: E402
                         op_bytes, op_call, parse_size)

# Overrides of module attributes of fp8_comm_hook.codec.triton_codec; "warps" fixes the warps of every launch.
SEGMENT_CONFIGS = [
    ("default", {}),
    ("tile 4096", {"_SEGMENT_TILE": 4096}),
    ("tile 2048", {"_SEGMENT_TILE": 2048}),
    ("tile 2048 8 warps", {"_SEGMENT_TILE": 2048, "warps": 8}),
    ("tile 1024", {"_SEGMENT_TILE": 1024}),
    ("tile 2048 lanes 16", {"_SEGMENT_TILE": 2048, "_SEGMENT_LANES": 16}),
    ("tile 2048 lanes 8", {"_SEGMENT_TILE": 2048, "_SEGMENT_LANES": 8}),
    ("tile 4096 lanes 16", {"_SEGMENT_TILE": 4096, "_SEGMENT_LANES": 16}),
    ("encode lanes 16", {"_SEGMENT_ENCODE_LANES": 16}),
    ("classes", {"SEGMENT_CLASSES": True}),
    ("classes encode lanes 16", {"SEGMENT_CLASSES": True, "_SEGMENT_ENCODE_LANES": 16}),
    ("classes tile 4096", {"SEGMENT_CLASSES": True, "_SEGMENT_TILE": 4096}),
]
REDUCE_CONFIGS = [("default", {})] + [
    (f"payload align {al} unroll {u} tile {t} {w} warps",
     {"_RECV_PAY_AL": al, "_RECV_UNROLL": u, "_QUANT_TILE": t, "warps": w})
    for al in (4, 16) for u in (4, 8) for t in (2048, 4096) for w in (4, 8)]
# The tensor/bucket-scaled reduce: an amax pass over the received rows, then a quantize pass.
SCALED_REDUCE_CONFIGS = [("default", {}),
                         ("amax lanes 32 align 4 tile 8192 (before)",
                          {"_RECV_AMAX_LANES": 32, "_RECV_PAY_AL": 4, "_RECV_AMAX_TILE": 8192})] + [
    (f"amax lanes {ln} tile {t}", {"_RECV_AMAX_LANES": ln, "_RECV_AMAX_TILE": t})
    for ln in (32, 128) for t in (2048, 4096, 8192)]


def apply(tc, overrides: dict) -> dict:
    """Set ``overrides`` on the codec module ``tc``; returns what to restore."""
    saved = {}
    for k, v in overrides.items():
        if k == "warps":
            for fn in ("_warps", "_encode_warps"):
                saved[fn] = getattr(tc, fn)
            setattr(tc, "_warps", lambda nb, bs, _w=v: _w)
            setattr(tc, "_encode_warps", lambda nb, bs, flat, contig, _w=v: _w)
        else:
            saved[k] = getattr(tc, k)
            setattr(tc, k, v)
    return saved


def reference(op, flat, L):
    """What the torch codec writes for ``op`` on this set (the bytes every configuration must match)."""
    import torch
    from fp8_comm_hook.codec.torch_codec import TorchCodec
    from fp8_comm_hook.formats import get_format
    tcodec = TorchCodec(get_format("e4m3"))
    if op == "quantize":
        tcodec.encode(flat, L)
        return L.send.clone()
    if op == "dequant_sum_requant":
        tcodec.reduce_shard(L)
        return L.gather_in.clone()
    out = torch.empty_like(flat)
    tcodec.decode(L, out)
    return out


def output_of(op, flat, L):
    return {"quantize": L.send, "dequant_sum_requant": L.gather_in}.get(op, flat)


def main():
    import torch
    from fp8_comm_hook.codec import triton_codec as tc
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="6.55M,64M,512M")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ops", default="quantize,dequantize,dequant_sum_requant")
    p.add_argument("--scalings", default="block,tensor")
    p.add_argument("--budget", type=float, default=0.15, help="seconds of timing per measurement")
    p.add_argument("--configs", default=None,
                   help="comma-separated configuration names to run (default: all; 'default' always runs)")
    p.add_argument("--out", default="benchmarks/results/codec-configs")
    a = p.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    ops = a.ops.split(",")
    bad = [o for o in ops if o not in ("quantize", "dequantize", "dequant_sum_requant")]
    if bad:
        raise ValueError(f"--ops: {bad} not allowed; allowed values: quantize, dequantize, dequant_sum_requant")
    known = list(dict.fromkeys(n for n, _ in SEGMENT_CONFIGS + REDUCE_CONFIGS + SCALED_REDUCE_CONFIGS))
    wanted = None
    if a.configs:
        wanted = {"default"} | {c.strip() for c in a.configs.split(",") if c.strip()}
        bad = sorted(wanted - set(known))
        if bad:
            raise ValueError(f"--configs: {bad} not known; allowed values: {', '.join(known)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_codec_configs needs a CUDA GPU (none visible)")
    copy = copy_bandwidth_gbps(0.3)
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}; copy ceiling {copy:.1f} GB/s", flush=True)
    l2 = l2_bytes()
    rows = []
    for numel in sizes:
        for dname in a.dtypes.split(","):
            dtype = getattr(torch, dname)
            for scaling in a.scalings.split(","):
                for op in ops:
                    # the reduce reads padded chunks only: the bucket's shape and dtype do not reach it
                    if op == "dequant_sum_requant" and dname != "float32":
                        continue
                    bucket = "aligned" if op == "dequant_sum_requant" else "odd"
                    if op == "dequant_sum_requant":
                        configs = REDUCE_CONFIGS if scaling == "block" else SCALED_REDUCE_CONFIGS
                    else:
                        configs = SEGMENT_CONFIGS if scaling == "block" or op == "quantize" else SEGMENT_CONFIGS[:3]
                    if wanted is not None:
                        configs = [c for c in configs if c[0] in wanted]
                    sets = [make_set(numel, dtype, scaling, 8, 128, bucket)]
                    nbytes = op_bytes(op, sets[0][1], numel, sets[0][0].element_size())
                    k = 1 if nbytes >= 3 * l2 else min(8, math.ceil(3 * l2 / nbytes))
                    while len(sets) < k:
                        sets.append(make_set(numel, dtype, scaling, 8, 128, bucket))
                    refs = [reference(op, f, L) for f, L in sets]
                    for name, over in configs:
                        saved = apply(tc, over)
                        try:
                            codec = make_codec("triton", "e4m3")
                            for (f, L), ref in zip(sets, refs):
                                out = output_of(op, f, L)
                                out.fill_(0x7F if out.dtype == torch.uint8 else 7.0)
                                op_call(codec, op, f, L)()
                                if not torch.equal(out, ref):
                                    raise AssertionError(f"{name}: {op} {dname} {scaling} {numel} differs from "
                                                         "the torch reference")
                            fns = [op_call(codec, op, f, L) for f, L in sets]
                            ms = graph_time_ms(fns, a.budget)
                        finally:
                            for kk, vv in saved.items():
                                setattr(tc, kk, vv)
                        row = dict(op=op, dtype=dname, bucket=bucket, scaling=scaling, numel=numel, config=name,
                                   us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9, copy_gbps=copy,
                                   default=name == "default")
                        rows.append(row)
                        print(f"{op:>20} {dname:>8} {bucket:>7} {scaling:>6} {numel:>11,d} {name:<32} "
                              f"{row['us']:9.1f} us {100 * row['gbps'] / copy:5.1f}% of copy", flush=True)
                    del sets, refs
                    torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = (r["op"], r["dtype"], r["scaling"], r["numel"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nfastest per case (against the default):")
    for key, r in best.items():
        d = next(x for x in rows if (x["op"], x["dtype"], x["scaling"], x["numel"]) == key and x["default"])
        print(f"{key[0]:>20} {key[1]:>8} {key[2]:>6} {key[3]:>11,d}: {r['config']:<32} {r['us']:8.1f} us "
              f"({100 * r['gbps'] / copy:5.1f}%), default {d['us']:8.1f} us ({100 * d['gbps'] / copy:5.1f}%)")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"device": dev, "copy_gbps": copy, "code_commit": commit,
                   "command": "python scripts/bench_codec_configs.py " + " ".join(sys.argv[1:]), "rows": rows},
                  f, indent=1)
    plot(rows, copy, a.out + ".png")


def plot(rows, copy, path):
    """Fraction of copy per configuration, one panel per (op, dtype, scaling, numel)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    cases = sorted({(r["op"], r["dtype"], r["scaling"], r["numel"]) for r in rows})
    cols = 3
    nrow = math.ceil(len(cases) / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(6 * cols, 0.18 * 40 * nrow + 1), squeeze=False)
    for ax, case in zip(axes.flat, cases):
        rs = [r for r in rows if (r["op"], r["dtype"], r["scaling"], r["numel"]) == case]
        ax.barh([r["config"] for r in rs], [r["gbps"] / copy for r in rs],
                color=["tab:red" if r["default"] else "tab:blue" for r in rs])
        ax.axvline(0.85, color="k", lw=0.8, ls="--")
        ax.set_title(f"{case[0]} {case[1]} {case[2]} {case[3]:,}", fontsize=8)
        ax.tick_params(labelsize=6)
        ax.set_xlim(0, 1.1)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    fig.suptitle("Triton codec launch configurations: fraction of the copy ceiling (red: default)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
