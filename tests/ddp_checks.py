"""Checks run inside spawned gloo worlds (see dist_harness). Each is ``fn(rank, world) -> value``;
assertions that need every rank's value happen in the test modules."""
import hashlib
import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from codec_ref import data
from fp8_comm_hook import FP8CommConfig, all_reduce, register_ddp_hook

CFG0 = dict(min_compress_numel=0)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def exact_mean(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().double().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def mlp(depth=6, width=96, seed=0, unused=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(40, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers += [nn.Linear(width, 10)]
    net = nn.Sequential(*layers)
    if unused:
        net = WithUnused(net)
    return net


class WithUnused(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.unused = nn.Linear(40, 333)

    def forward(self, x):
        return self.net(x)


def batch(rank, step, n=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 40, generator=g).to(dtype)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def local_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x).float(), y).backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
