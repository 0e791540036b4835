"""Counters of what the hooks sent (cumulative since registration) and every byte formula: what one
rank sends in each wire algorithm and in the uncompressed baselines it is compared with."""
import threading
from typing import Dict

import torch

__all__ = ["CommStats", "ring_allreduce_bytes", "ring_reduce_scatter_bytes", "ring_bytes", "two_shot_bytes",
           "fp8_reduce_scatter_bytes", "fp8_sum_bytes"]


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2(W-1)/W * nbytes."""
    return 2 * (world_size - 1) * nbytes // world_size


def ring_reduce_scatter_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of ``nbytes``: (W-1)/W * nbytes."""
    return (world_size - 1) * nbytes // world_size


def ring_bytes(collective: str, nbytes: int, world_size: int) -> int:
    """:func:`ring_allreduce_bytes` for ``collective="all_reduce"``, :func:`ring_reduce_scatter_bytes`
    for ``"reduce_scatter"``; ``ValueError`` otherwise."""
    if collective == "all_reduce":
        return ring_allreduce_bytes(nbytes, world_size)
    if collective == "reduce_scatter":
        return ring_reduce_scatter_bytes(nbytes, world_size)
    raise ValueError(f"collective must be one of ['all_reduce', 'reduce_scatter'], got {collective!r}")


def two_shot_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in ``two_shot``: W-1 packed chunks in the all-to-all, its packed shard to
    W-1 ranks in the all-gather."""
    return 2 * (world_size - 1) * chunk_bytes


def fp8_reduce_scatter_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in the FP8 reduce-scatter (two_shot's first half): W-1 packed chunks."""
    return (world_size - 1) * chunk_bytes


def fp8_sum_bytes(payload_numel: int, num_groups: int, world_size: int, scatter: bool = False) -> int:
    """Bytes one rank sends in an FP8 sum (``nccl_fp8``): ring all-reduces of the fp32 amax vector
    (``num_groups`` values) and of the ``payload_numel`` FP8 bytes, or with ``scatter`` a ring
    reduce-scatter of the FP8 bytes (``payload_numel`` is a multiple of W)."""
    if scatter:
        return ring_allreduce_bytes(4 * num_groups, world_size) + ring_reduce_scatter_bytes(payload_numel, world_size)
    return ring_allreduce_bytes(4 * num_groups + payload_numel, world_size)


class CommStats:
    """Host counters plus device-side counters (non-finite buckets, saturated values) that are only
    read when :meth:`as_dict` is called, so the step path never synchronises the device."""

    HOST_KEYS = ("steps", "bytes_sent", "bytes_baseline", "compressed_buckets", "uncompressed_buckets", "bf16_buckets")
    DEVICE_KEYS = ("nonfinite_buckets", "saturated_values")

    def __init__(self):
        self.host: Dict[str, int] = {k: 0 for k in self.HOST_KEYS}
        self._device: Dict[torch.device, torch.Tensor] = {}
        self._restored = {k: 0 for k in self.DEVICE_KEYS}
        self._lock = threading.Lock()  # the hook thread and a communication worker both add

    def add(self, key: str, n: int) -> None:
        """Add ``n`` to host counter ``key``."""
        with self._lock:
            self.host[key] += int(n)

    def add_bucket(self, counter: str, baseline_bytes: int) -> None:
        """One bucket: add 1 to ``counter`` and ``baseline_bytes`` to ``bytes_baseline`` (one lock)."""
        with self._lock:
            self.host[counter] += 1
            self.host["bytes_baseline"] += baseline_bytes

    def device_counters(self, device: torch.device) -> torch.Tensor:
        """The int64 device counters of ``device`` (one per :attr:`DEVICE_KEYS`), allocated on first
        use (a captured CUDA graph adds to them, so they must exist before capture)."""
        buf = self._device.get(device)
        if buf is None:
            buf = self._device[device] = torch.zeros(len(self.DEVICE_KEYS), dtype=torch.int64, device=device)
        return buf

    def add_device(self, key: str, value: torch.Tensor) -> None:
        """Add a device scalar (bool or int) to device counter ``key`` without synchronising."""
        with self._lock:
            self.device_counters(value.device)[self.DEVICE_KEYS.index(key)] += value.to(torch.int64)

    def as_dict(self) -> Dict[str, int]:
        """All counters as plain ints (reads the device counters: a synchronisation)."""
        out = dict(self.host)
        for i, k in enumerate(self.DEVICE_KEYS):
            out[k] = self._restored[k] + sum(int(b[i].item()) for b in self._device.values())
        return out

    def load(self, d: Dict[str, int]) -> None:
        """Restore counters from :meth:`as_dict` output."""
        for k in self.HOST_KEYS:
            self.host[k] = int(d.get(k, 0))
        self._device.clear()
        self._restored = {k: int(d.get(k, 0)) for k in self.DEVICE_KEYS}
