"""fp8_comm_hook: FP8 gradient communication for PyTorch data parallelism.

One hook on a native ``DistributedDataParallel`` model (:func:`register_ddp_hook`) sends gradients
over the wire in FP8 (E4M3 or E5M2 with fp32 scales): half the bytes of a bf16 all-reduce, a quarter
of fp32, with the averaged result bit-identical on every rank.
"""
from .config import FP8CommConfig
from .ddp import fp8_hook, register_ddp_hook
from .formats import FP8Format, get_format
from .fsdp import register_fsdp_hook
from .integrations.cli import add_cli_args, config_from_args, grad_comm_from_args, register_grad_comm
from .reduce import all_reduce
from .registry import comm_state
from .state import FP8CommState

__version__ = "0.1.0"

__all__ = ["FP8CommConfig", "FP8CommState", "FP8Format", "add_cli_args", "all_reduce", "comm_state", "config_from_args",
           "fp8_hook", "get_format", "grad_comm_from_args", "register_ddp_hook", "register_fsdp_hook", "register_grad_comm",
           "__version__"]
