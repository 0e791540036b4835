"""Hugging Face ``transformers.Trainer``: FP8 gradient communication through a callback.

The Trainer wraps the model in DDP (through Accelerate) inside ``train()``, after the user last sees
it, so the hook goes on in the callback's ``on_train_begin``, which runs after the wrapping and
before the first backward::

    from transformers import Trainer
    from fp8_comm_hook import FP8CommConfig
    from fp8_comm_hook.integrations.transformers import register_trainer_hook

    trainer = Trainer(model=model, args=training_args, train_dataset=ds)
    callback = register_trainer_hook(trainer, FP8CommConfig())
    trainer.train()
    print(callback.state.stats())       # bytes on the wire vs the fp32 all-reduce

Launch as usual (``torchrun --nproc-per-node N train.py``). With one process the Trainer does not
wrap the model; the callback logs that and registers nothing.
"""
import logging
from typing import Optional

import torch
from transformers import TrainerCallback

from .. import registry
from ..config import FP8CommConfig
from ..ddp import register_ddp_hook
from ..state import FP8CommState

__all__ = ["FP8CommCallback", "register_trainer_hook"]

log = logging.getLogger("fp8_comm_hook")


class FP8CommCallback(TrainerCallback):
    """A ``TrainerCallback`` that registers :func:`fp8_comm_hook.fp8_hook` on ``trainer.model_wrapped``
    when training begins. ``state`` is the hook's :class:`FP8CommState` (None until registered, or
    when the model is not DDP-wrapped). A later ``train()`` call on the same DDP wrapper reuses the
    registered hook; on a new wrapper it registers again (a fresh state)."""

    def __init__(self, trainer, config: Optional[FP8CommConfig] = None):
        if config is not None and not isinstance(config, FP8CommConfig):
            raise TypeError(f"config must be an FP8CommConfig or None, got {type(config).__name__}")
        self.trainer = trainer
        self.config = config if config is not None else FP8CommConfig()
        self.state: Optional[FP8CommState] = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            log.info("fp8_comm_hook: the Trainer's model is %s, not DDP (world size %s); FP8 hook not registered",
                     type(model).__name__, getattr(args, "world_size", "?"))
            return control
        existing = registry.comm_state(model)
        self.state = existing if existing is not None else register_ddp_hook(model, self.config)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        """Before every optimizer step's forward and backward passes: tell the FP8 state the loss
        scale of fp16 mixed precision (the Trainer's ``accelerator.scaler``), so error-feedback
        residuals follow its changes. Nothing without a registered state or a scaler."""
        if self.state is not None:
            self.state.follow_grad_scaler(getattr(getattr(self.trainer, "accelerator", None), "scaler", None))
        return control


def register_trainer_hook(trainer, config: Optional[FP8CommConfig] = None) -> FP8CommCallback:
    """Add an :class:`FP8CommCallback` for ``config`` to ``trainer`` (before ``trainer.train()``) and
    return it; its ``state`` holds the hook's state and stats once training has begun."""
    callback = FP8CommCallback(trainer, config)
    trainer.add_callback(callback)
    return callback
