"""What this package registered on which model: its :class:`~fp8_comm_hook.state.FP8CommState` and,
for the baseline modes of :func:`~fp8_comm_hook.integrations.cli.register_grad_comm`, the dtype that
goes on the wire. Kept here, keyed weakly by the model object, instead of attributes set on models.
"""
import weakref
from typing import Optional

import torch

__all__ = ["comm_state", "record_state", "grad_comm_wire_dtype", "record_wire_dtype", "model_device"]

_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
_WIRE_DTYPES: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[torch.dtype]]" = weakref.WeakKeyDictionary()


def comm_state(model: torch.nn.Module):
    """The :class:`~fp8_comm_hook.state.FP8CommState` registered on ``model`` (a DDP model, a root
    FSDP1 module or an FSDP2 module), or None.

    Example::

        register_ddp_hook(model, cfg)
        assert fp8_comm_hook.comm_state(model).stats()["steps"] == 0
    """
    return _STATES.get(model)


def record_state(model: torch.nn.Module, state) -> None:
    """Remember that ``state`` is registered on ``model`` (called by the register functions)."""
    _STATES[model] = state


def grad_comm_wire_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype a baseline gradient communication set up by ``register_grad_comm`` puts on the wire
    (fp32 for "none", bf16 or fp32 for "bf16"); None for "fp8" (its state counts its own bytes) or a
    model ``register_grad_comm`` did not set up."""
    return _WIRE_DTYPES.get(model)


def record_wire_dtype(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Remember the wire dtype of ``model``'s gradient communication."""
    _WIRE_DTYPES[model] = dtype


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
