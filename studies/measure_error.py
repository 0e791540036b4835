"""Relative L2 error of ``fp8_comm_hook.all_reduce`` against the exact fp64 mean, per format, data
kind, scaling mode and world size (gloo on CPU, independent seeded data per rank, 100,003 elements).

    python studies/measure_error.py --worlds 2 3 4 --out benchmarks/results/error-table.json
"""
import argparse
import json
import os
import sys
import tempfile

import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--out", default="benchmarks/results/error-table.json")
    a = p.parse_args()
    from dist_harness import run_world, values
    from test_ddp import chk_all_reduce_error

    table = {}
    for w in a.worlds:
        r0 = values(run_world(w, [chk_all_reduce_error]), "chk_all_reduce_error")[0]
        for (fmt, kind, scaling), (err, _) in r0.items():
            table.setdefault(f"{fmt}/{kind}/{scaling}", {})[w] = err
    print(f"{'format/data/scaling':<28}" + "".join(f"{'world ' + str(w):>10}" for w in a.worlds))
    for k, row in table.items():
        print(f"{k:<28}" + "".join(f"{row[w]:>10.4f}" for w in a.worlds))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"metric": "relative L2 error vs exact fp64 mean", "numel": 100_003, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
