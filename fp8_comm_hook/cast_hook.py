"""The cast baseline as DDP comm hooks: cast the bucket to bf16, divide by the world size, SUM
all-reduce, cast back (what torch's ``default_hooks.bf16_compress_hook`` does; torch's own is NCCL-only
by name). One recipe, :func:`fp8_comm_hook.collectives.cast_all_reduce`, backs both hooks, as torch's
``_compress_hook`` backs its fp16 and bf16 hooks.

No ``from __future__ import annotations`` here: DDP inspects the hooks' signatures.
"""
import torch
import torch.distributed as dist

from .collectives import cast_all_reduce

__all__ = ["bf16_allreduce_hook", "bf16_emulated_hook"]


def _cast_hook(process_group, bucket, sum_in_wire_dtype: bool) -> torch.futures.Future:
    group = process_group if process_group is not None else dist.group.WORLD
    work, finish = cast_all_reduce(bucket.buffer(), group, wire_dtype=torch.bfloat16,
                                   sum_in_wire_dtype=sum_in_wire_dtype, async_op=True)
    return work.get_future().then(lambda fut: finish())


def bf16_allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook doing what torch's ``bf16_compress_hook`` does (bf16 on the wire, summed in bf16),
    for any backend that can all-reduce bf16. Register with
    ``ddp.register_comm_hook(process_group, bf16_allreduce_hook)``; returns the bucket's mean."""
    return _cast_hook(process_group, bucket, sum_in_wire_dtype=True)


def bf16_emulated_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook for backends that cannot all-reduce bf16: the bucket is cast to bf16 and divided by
    the world size, summed in fp32, and the mean rounded to bf16 again. The numerics of a bf16
    all-reduce; fp32 bytes on the wire. Returns the bucket's mean."""
    return _cast_hook(process_group, bucket, sum_in_wire_dtype=False)
