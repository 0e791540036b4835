"""Hugging Face ``transformers.Trainer`` with FP8 gradient communication: a small MLP on
scikit-learn's digits, the hook registered by ``register_trainer_hook``.

    torchrun --standalone --nproc-per-node 2 examples/transformers_trainer_fp8.py --cpu   # CPU, gloo
    torchrun --standalone --nproc-per-node 8 examples/transformers_trainer_fp8.py         # GPUs, NCCL

Prints one JSON line on the main process: losses, held-out accuracy and the hook's stats.
"""
import argparse
import json
import tempfile

import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from transformers import PrinterCallback, Trainer, TrainingArguments

from fp8_comm_hook import FP8CommConfig
from fp8_comm_hook.integrations.transformers import register_trainer_hook


class DigitsMLP(nn.Module):
    """The Trainer calls ``model(**batch)`` and reads ``loss`` from the output."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cpu", action="store_true", help="force CPU (gloo)")
    a = p.parse_args()
    cpu = a.cpu or not torch.cuda.is_available()
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    tr, te = perm[:1400], perm[1400:]
    torch.manual_seed(0)
    model = DigitsMLP()
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=32,
                                 learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1,
                                 save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=cpu,
                                 ddp_backend="gloo" if cpu else None, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=Rows(x[tr], y[tr]))
        trainer.remove_callback(PrinterCallback)  # one JSON line at the end instead of a dict per step
        callback = register_trainer_hook(trainer, FP8CommConfig(min_compress_numel=0))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        with torch.no_grad():
            acc = (model(x[te].to(trainer.args.device))["logits"].argmax(1).cpu() == y[te]).float().mean().item()
        print(json.dumps(dict(first_loss=losses[0], last_loss=sum(losses[-10:]) / 10, accuracy=acc,
                              stats=callback.state.stats() if callback.state else None,
                              world_size=trainer.args.world_size, wrapped=type(trainer.model_wrapped).__name__)))
    if torch.distributed.is_initialized():
        # Gloo worker threads still holding work at interpreter shutdown can abort the process.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
