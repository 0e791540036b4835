"""PyTorch Lightning: a ``DDPStrategy`` that sends gradients in FP8.

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` takes a hook, but registers it
only on CUDA and never binds parameter names. :class:`FP8DDPStrategy` registers through
:func:`fp8_comm_hook.register_ddp_hook` on every device type (gloo on CPU too), so names are bound,
configs are checked across ranks and a second registration is refused. Under ``precision="16-mixed"``
it tells the state the GradScaler's loss scale before every backward
(:meth:`~fp8_comm_hook.FP8CommState.set_loss_scale`), so error feedback follows the scale.

Example::

    import lightning as L
    from fp8_comm_hook import FP8CommConfig
    from fp8_comm_hook.integrations.lightning import lightning_strategy

    trainer = L.Trainer(strategy=lightning_strategy(FP8CommConfig(fp8_format="e4m3")), devices=8)
    trainer.fit(module)
    trainer.strategy.fp8_comm_state.stats()
"""
from typing import Optional

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package name
    from pytorch_lightning.strategies import DDPStrategy

from ..config import FP8CommConfig
from ..ddp import fp8_hook, register_ddp_hook
from ..state import FP8CommState

__all__ = ["FP8DDPStrategy", "lightning_strategy"]


class FP8DDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose DDP model averages gradients with :func:`fp8_hook`.

    Args:
      config: the :class:`FP8CommConfig` (default: the defaults).
      **kwargs: passed to ``DDPStrategy`` (``find_unused_parameters``, ``static_graph``,
        ``bucket_cap_mb``, ``process_group_backend``, ...).
    """

    strategy_name = "ddp_fp8"

    def __init__(self, config: Optional[FP8CommConfig] = None, **kwargs):
        if "ddp_comm_hook" in kwargs or "ddp_comm_state" in kwargs:
            raise ValueError("FP8DDPStrategy sets ddp_comm_hook/ddp_comm_state itself; pass config= instead")
        self.fp8_config = config if config is not None else FP8CommConfig()
        # Lightning keeps these for its own registration path; ours replaces that path.
        super().__init__(ddp_comm_state=FP8CommState(self.fp8_config), ddp_comm_hook=fp8_hook, **kwargs)

    def _register_ddp_hooks(self) -> None:
        self._ddp_comm_state = register_ddp_hook(self.model, self.fp8_config)

    def pre_backward(self, closure_loss) -> None:
        """Lightning's hook before every backward: also tells the state the precision plugin's loss
        scale (``precision="16-mixed"``), so error-feedback residuals follow its changes."""
        super().pre_backward(closure_loss)
        self._ddp_comm_state.follow_grad_scaler(getattr(self.precision_plugin, "scaler", None))

    @property
    def fp8_comm_state(self) -> FP8CommState:
        """The registered state (stats, state_dict); valid once the trainer has set up DDP."""
        return self._ddp_comm_state


def lightning_strategy(config: Optional[FP8CommConfig] = None, **ddp_kwargs) -> FP8DDPStrategy:
    """Build an :class:`FP8DDPStrategy` from ``config``; the state binds to the model when Lightning
    wraps it in DDP. Returns the strategy for ``Trainer(strategy=...)``."""
    return FP8DDPStrategy(config, **ddp_kwargs)
