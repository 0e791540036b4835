"""Hugging Face Accelerate: register the FP8 hook on the model that ``accelerator.prepare`` returns.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only torch's built-in hooks, so
register ours after ``prepare``, before the first backward::

    from accelerate import Accelerator
    from fp8_comm_hook import FP8CommConfig
    from fp8_comm_hook.integrations.accelerate import register_accelerate_hook

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_accelerate_hook(accelerator, model, FP8CommConfig())

From a ``transformers.Trainer`` (which drives Accelerate and wraps the model inside ``train()``):
register in a callback's ``on_step_begin`` on ``trainer.model_wrapped`` once it is a
``DistributedDataParallel`` (see the README).
"""
import logging
from typing import Optional

import torch

from ..config import FP8CommConfig
from ..ddp import register_ddp_hook
from ..state import FP8CommState

__all__ = ["register_accelerate_hook"]

log = logging.getLogger("fp8_comm_hook")


def register_accelerate_hook(accelerator, model: torch.nn.Module,
                             config: Optional[FP8CommConfig] = None) -> Optional[FP8CommState]:
    """Register :func:`fp8_comm_hook.fp8_hook` on ``model`` (as returned by ``accelerator.prepare``)
    and return its :class:`FP8CommState`; returns None, with a log line, when Accelerate did not wrap
    the model in DDP (a single process: nothing to communicate). With fp16 mixed precision
    (``accelerator.scaler`` set) a forward pre-hook tells the state the loss scale before every
    forward (:meth:`~fp8_comm_hook.FP8CommState.set_loss_scale`)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        log.info("fp8_comm_hook: %s is not DDP-wrapped (distributed_type=%s); FP8 hook not registered",
                 type(model).__name__, getattr(accelerator, "distributed_type", "?"))
        return None
    state = register_ddp_hook(model, config)
    if getattr(accelerator, "scaler", None) is not None:
        # fp16 mixed precision: before every forward (so before every backward), tell the state the
        # loss scale, so error-feedback residuals follow the scaler's changes.
        def follow_scale(module, args):  # a pre-hook's return value would replace the inputs: return None
            state.follow_grad_scaler(accelerator.scaler)

        model.register_forward_pre_hook(follow_scale)
    return state
