#!/usr/bin/env python
"""Run codec ops a few times each for a profiler (ncu) and print their GPU time from CUDA-graph replays.

    python scripts/profile_codec.py --backend triton --sizes 64M --dtypes float32,bfloat16 --scalings block
    ncu --clock-control none -k regex:_quant|_dequant|_amax python scripts/profile_codec.py --reps 2 --no-time
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402
from bench_codec import (make_codec, make_set, op_bytes, op_call, parse_size, graph_time_ms,  # noqa: E402
                         copy_bandwidth_gbps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="triton")
    p.add_argument("--sizes", default="64M")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--scalings", default="block")
    p.add_argument("--ops", default="quantize,dequant_sum_requant,dequantize")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-time", action="store_true")
    a = p.parse_args()
    codec = make_codec(a.backend, "e4m3")
    copy = None if a.no_time else copy_bandwidth_gbps(0.05)
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        for dn in a.dtypes.split(","):
            dt = getattr(torch, dn)
            for sc in a.scalings.split(","):
                flat, L = make_set(size, dt, sc, 8, 128)
                for op in a.ops.split(","):
                    fn = op_call(codec, op, flat, L)
                    for _ in range(a.reps):
                        fn()
                    torch.cuda.synchronize()
                    if not a.no_time:
                        ms = graph_time_ms([fn], 0.05)
                        nb = op_bytes(op, L, size, flat.element_size())
                        print(f"{a.backend} {op:>20} {sc:>6} {dn:>8} {size:>11} {ms * 1e3:9.1f} us "
                              f"{nb / ms / 1e6:8.0f} GB/s {nb / ms / 1e6 / copy:6.3f} of copy", flush=True)


if __name__ == "__main__":
    main()
