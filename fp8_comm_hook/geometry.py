"""Scale-group geometry: which fp32 scale each block of a ``rows x chunk_numel`` buffer uses.

Shapes only, no buffers: the codecs import this module (not :mod:`fp8_comm_hook.layout`), and the
layout builds one :class:`ScaleGroups` per scaling mode from its parameter offsets.
"""
import dataclasses
from typing import Optional

import torch

__all__ = ["ScaleGroups", "round_up"]


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return (n + m - 1) // m * m


@dataclasses.dataclass(eq=False)  # compared and hashed by identity: codecs key workspaces on it
class ScaleGroups:
    """Which scale each block of ``rows x chunk_numel`` elements uses.

    ``block_group`` maps block i (of ``rows * chunk_numel / block_size``) to its scale index in
    ``[0, rows * groups_per_row)``; ``None`` means one scale per block (block scaling).
    """

    rows: int
    chunk_numel: int
    block_size: int
    groups_per_row: int
    block_group: Optional[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        """Blocks in all rows together."""
        return self.rows * self.chunk_numel // self.block_size

    @property
    def num_groups(self) -> int:
        """Scales in all rows together."""
        return self.rows * self.groups_per_row

    def replicate(self, times: int) -> "ScaleGroups":
        """The same per-row geometry repeated ``times`` times (``rows`` must be 1)."""
        assert self.rows == 1
        bg = None
        if self.block_group is not None:
            offs = torch.arange(times, device=self.block_group.device).repeat_interleave(self.block_group.numel())
            bg = self.block_group.repeat(times) + offs * self.groups_per_row
        return ScaleGroups(times, self.chunk_numel, self.block_size, self.groups_per_row, bg)

    def row(self, r: int) -> "ScaleGroups":
        """The geometry of row ``r`` alone, with scale indices local to that row."""
        bg = None
        if self.block_group is not None:
            bpr = self.chunk_numel // self.block_size
            bg = self.block_group[r * bpr:(r + 1) * bpr] - r * self.groups_per_row
        return ScaleGroups(1, self.chunk_numel, self.block_size, self.groups_per_row, bg)
