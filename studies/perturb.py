"""Perturbations of a training run, for the convergence study's fp32 yardsticks.

``scripts/train.py --init-perturbation REL`` and ``--grad-perturbation REL`` call these (the trainer
imports this module only when one of the flags is set): a run of the same seed that starts a hair
away, or whose averaged gradient is nudged (or noised) at every step, measures how far training's
own chaos, or gradient error of a given size, carries a run (``studies/compare_convergence.py``,
modes ``none-perturbed-*`` and ``none-noised-grads-*``).
"""
import torch
import torch.nn as nn


def perturb_init(net: nn.Module, rel: float, seed: int) -> float:
    """Multiply every floating-point parameter of ``net`` in place by ``1 + rel * z``, z standard
    normal, drawn on the CPU from its own generator seeded with ``seed`` (the same numbers on every
    rank and device; torch's global RNG is not touched). Returns the largest ``|rel * z|`` applied
    (0.0, and ``net`` untouched, when ``rel`` is 0)."""
    if rel == 0:
        return 0.0
    gen = torch.Generator().manual_seed(seed)
    largest = 0.0
    with torch.no_grad():
        for p in net.parameters():
            if not p.is_floating_point():
                continue
            z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_((p.detach().cpu().double() * (1 + rel * z)).to(p.dtype))
            largest = max(largest, rel * z.abs().max().item())
    return largest


def perturb_grads(model: nn.Module, rel: float, gen: torch.Generator) -> None:
    """Multiply every gradient of ``model`` in place by ``1 + rel * z``, z standard normal (fp32)
    drawn from ``gen`` on the gradients' device, parameter by parameter: seeded alike on every rank,
    it keeps DDP's replicas identical."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                z = torch.randn(p.grad.shape, generator=gen, device=p.grad.device, dtype=p.grad.dtype)
                p.grad.addcmul_(p.grad, z, value=rel)
