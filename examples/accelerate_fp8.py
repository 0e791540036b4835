"""Hugging Face Accelerate with FP8 gradient communication: a small MLP on scikit-learn's digits.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_fp8.py      # CPU, gloo
    accelerate launch --num_processes 8 examples/accelerate_fp8.py            # GPUs

Prints one JSON line on the main process: losses, held-out accuracy and the hook's stats.
"""
import argparse
import json

import torch
import torch.nn as nn
from accelerate import Accelerator
from sklearn.datasets import load_digits

from fp8_comm_hook import FP8CommConfig
from fp8_comm_hook.integrations.accelerate import register_accelerate_hook


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cpu", action="store_true", help="force CPU (gloo)")
    a = p.parse_args()
    accelerator = Accelerator(cpu=a.cpu or not torch.cuda.is_available())
    torch.manual_seed(0)
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    tr, te = perm[:1400], perm[1400:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[tr], y[tr]), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register_accelerate_hook(accelerator, model, FP8CommConfig(min_compress_numel=0))
    losses, step = [], 0
    while step < a.steps:
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step >= a.steps:
                break
    if accelerator.is_main_process:
        net = accelerator.unwrap_model(model)
        with torch.no_grad():
            acc = (net(x[te].to(accelerator.device)).argmax(1).cpu() == y[te]).float().mean().item()
        print(json.dumps(dict(first_loss=losses[0], last_loss=sum(losses[-10:]) / 10, accuracy=acc,
                              stats=state.stats() if state else None, world_size=accelerator.num_processes,
                              wrapped=type(model).__name__)))
    # Destroys the process groups (the hook's side group included) while the interpreter is alive: gloo
    # worker threads still holding work at interpreter shutdown can abort the process.
    accelerator.end_training()


if __name__ == "__main__":
    main()
