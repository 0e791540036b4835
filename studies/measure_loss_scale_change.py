"""What a dynamic loss-scale change does to error feedback: the relative L2 error of the unscaled
averaged gradient against the exact fp64 mean, per step, for DDP with the FP8 hook (E4M3 two_shot,
block scaling, 4-layer MLP, gloo on CPU), when the loss scale is 1024 throughout, halves to 512 at
step 6 with the state told (``set_loss_scale``), halves untold, doubles untold, and without error
feedback. Prints the table of docs/numerics.md and writes the per-step errors as JSON.

    python studies/measure_loss_scale_change.py --worlds 2 3 --out benchmarks/results/loss-scale-change.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

STEPS, CHANGE_AT, SCALE = 12, 6, 1024.0
MODES = ("constant", "halved_told", "halved_not_told", "grown_not_told", "no_error_feedback")


def chk_loss_scale_change(rank, W):
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nonfinite_checks as nc
    from ddp_checks import exact_mean, mlp, rel_err
    from fp8_comm_hook import FP8CommConfig, register_ddp_hook

    out = {}
    for mode in MODES:
        net, ref = mlp(depth=4, width=64), mlp(depth=4, width=64)
        d = DDP(net, bucket_cap_mb=0.02)
        st = register_ddp_hook(d, FP8CommConfig(min_compress_numel=0, error_feedback=mode != "no_error_feedback"))
        errs = []
        for step in range(STEPS):
            s = SCALE
            if step >= CHANGE_AT and mode.startswith("halved"):
                s = SCALE / 2
            elif step >= CHANGE_AT and mode.startswith("grown"):
                s = SCALE * 2
            if not mode.endswith("not_told"):
                st.set_loss_scale(s)
            x, y = nc._batch(rank, step, "cpu")
            local = nc._grads(ref, x, y)
            d.zero_grad()
            (nn.functional.cross_entropy(d(x), y) * s).backward()
            got = torch.cat([p.grad.double().flatten() / s for p in net.parameters()])
            mean = torch.cat([exact_mean(local[n]).flatten() for n, _ in ref.named_parameters()])
            errs.append(rel_err(got, mean))
        out[mode] = errs
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--out", default="benchmarks/results/loss-scale-change.json")
    a = p.parse_args()
    from dist_harness import run_world, values

    result = {"steps": STEPS, "change_at": CHANGE_AT, "scale": SCALE, "worlds": {}}
    print(f"relative L2 error of the unscaled mean at step {CHANGE_AT} (the scale changes there); "
          f"mean over steps 1-{STEPS - 1}")
    print(f"{'world':>5} " + " ".join(f"{m:>18}" for m in MODES))
    for w in a.worlds:
        errs = values(run_world(w, [chk_loss_scale_change]), "chk_loss_scale_change")[0]
        result["worlds"][w] = errs
        print(f"{w:>5} " + " ".join(f"{errs[m][CHANGE_AT]:>10.4f} ({sum(errs[m][1:]) / (STEPS - 1):.4f})" for m in MODES))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
