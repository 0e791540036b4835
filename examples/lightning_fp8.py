"""PyTorch Lightning with FP8 gradient communication: a small MLP on scikit-learn's digits.

    python examples/lightning_fp8.py --devices 2            # CPU, gloo, 2 processes
    python examples/lightning_fp8.py --devices 8 --accelerator gpu

Prints one JSON line on rank 0: first/last training loss, held-out accuracy and the hook's stats.
"""
import argparse
import json

import lightning as L
import torch
import torch.nn as nn
from sklearn.datasets import load_digits

from fp8_comm_hook import FP8CommConfig
from fp8_comm_hook.integrations.lightning import lightning_strategy


class DigitsMLP(L.LightningModule):
    def __init__(self, lr=3e-3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.lr = lr
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--fp8-format", default="e4m3")
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    tr, te = perm[:1400], perm[1400:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[tr], y[tr]), batch_size=32, shuffle=True)
    module = DigitsMLP()
    cfg = FP8CommConfig(fp8_format=a.fp8_format, min_compress_numel=0)
    trainer = L.Trainer(strategy=lightning_strategy(cfg), accelerator=a.accelerator, devices=a.devices,
                        max_steps=a.max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        with torch.no_grad():
            acc = (module.net(x[te]).argmax(1) == y[te]).float().mean().item()
        stats = trainer.strategy.fp8_comm_state.stats()
        print(json.dumps(dict(first_loss=module.losses[0], last_loss=sum(module.losses[-10:]) / 10,
                              accuracy=acc, stats=stats, world_size=trainer.world_size)))
    if torch.distributed.is_initialized():
        # Gloo worker threads still holding work at interpreter shutdown can abort the process.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
