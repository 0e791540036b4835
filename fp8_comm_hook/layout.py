"""The grad-bucket manager: a padded, block-aligned mirror of one gradient bucket.

For a bucket holding parameters p_0..p_k (contiguous in DDP's flat bucket buffer), the layout places
each parameter on a block boundary of a padded fp32 buffer whose size is a multiple of
``world_size * block_size``, splits that buffer into ``world_size`` equal shards ("chunks"; rank r
owns chunk r), derives the scale groups of the configured scaling mode, and owns every buffer the
wire algorithms reuse each step (the fp32 staging and work buffers, the packed uint8 send, receive
and gather buffers, and the scale scratch). Nothing here depends on the codec backend.

Packed chunk format (one per destination, identical size on every rank)::

    [ chunk_numel FP8 payload bytes | groups_per_chunk fp32 scale_inv values ]

``chunk_numel`` is a multiple of ``block_size`` (>= 16), so the scales start 4-byte aligned.
"""
import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["ScaleGroups", "BucketLayout"]


@dataclasses.dataclass
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


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class BucketLayout:
    """Geometry and preallocated buffers for one bucket on one rank.

    Args:
      numels: element count of each parameter's gradient, in bucket order.
      src_offsets: element offset of each gradient in the flat source buffer.
      names: a stable key per parameter (its name when bound to a model, else an identity key).
      world_size, rank: of the process group the bucket is averaged over.
      block_size: scaling block; every parameter starts on a block boundary.
      scaling: "block", "tensor" (one scale per parameter segment within a chunk) or "bucket"
        (one scale per chunk).
      src_numel: numel of the source buffer; dtype/device: of the source buffer.
    """

    def __init__(self, numels: Sequence[int], src_offsets: Sequence[int], names: Sequence[str],
                 world_size: int, rank: int, block_size: int, scaling: str, src_numel: int,
                 dtype: torch.dtype, device: torch.device):
        if not (len(numels) == len(src_offsets) == len(names)):
            raise ValueError("numels, src_offsets and names must have the same length")
        self.world_size, self.rank, self.block_size, self.scaling = world_size, rank, block_size, scaling
        self.src_numel, self.dtype, self.device = src_numel, dtype, torch.device(device)
        self.names = list(names)
        self.numels = [int(n) for n in numels]
        self.src_offsets = [int(o) for o in src_offsets]
        # Each parameter starts on a block boundary of the padded buffer.
        self.dst_offsets: List[int] = []
        pos = 0
        for n in self.numels:
            self.dst_offsets.append(pos)
            pos += _round_up(n, block_size)
        self.data_numel = pos
        self.padded_numel = max(_round_up(pos, world_size * block_size), world_size * block_size)
        self.chunk_numel = self.padded_numel // world_size
        self.blocks_per_chunk = self.chunk_numel // block_size
        self.copy_runs = self._merge_runs()
        self.groups = self._derive_groups()
        self.chunk_bytes = self.chunk_numel + 4 * self.groups.groups_per_row
        self.own_groups = self.groups.row(rank)
        self.own_groups_all_sources = self.own_groups.replicate(world_size)
        self._alloc()

    # ------------------------------------------------------------------ geometry
    def _merge_runs(self) -> List[Tuple[int, int, int]]:
        """(src_offset, dst_offset, numel) copies; adjacent parameters with no padding between
        them in both buffers merge into one copy."""
        runs: List[List[int]] = []
        for s, d, n in zip(self.src_offsets, self.dst_offsets, self.numels):
            if n == 0:
                continue
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1][2] += n
            else:
                runs.append([s, d, n])
        return [tuple(r) for r in runs]

    def _derive_groups(self) -> ScaleGroups:
        W, bs, C = self.world_size, self.block_size, self.chunk_numel
        bpc = self.blocks_per_chunk
        if self.scaling == "block":
            return ScaleGroups(W, C, bs, bpc, None)
        if self.scaling == "bucket":
            bg = torch.arange(W, dtype=torch.int64).repeat_interleave(bpc)
            return ScaleGroups(W, C, bs, 1, bg.to(self.device))
        # tensor: a new group wherever the parameter changes or a chunk starts; padding blocks after
        # the last parameter join the group before them (zeros do not change an amax).
        starts = torch.tensor([d for d, n in zip(self.dst_offsets, self.numels) if n > 0] or [0], dtype=torch.int64)
        block_start = torch.arange(W * bpc, dtype=torch.int64) * bs
        seg = torch.searchsorted(starts, block_start, right=True) - 1
        change = torch.zeros(W * bpc, dtype=torch.int64)
        change[1:] = (seg[1:] != seg[:-1]).to(torch.int64)
        change = change.view(W, bpc)
        change[:, 0] = 0
        local = torch.cumsum(change, dim=1)
        G = int(local.max().item()) + 1
        bg = (local + torch.arange(W, dtype=torch.int64)[:, None] * G).reshape(-1)
        return ScaleGroups(W, C, bs, G, bg.to(self.device))

    def _alloc(self) -> None:
        W, P, dev = self.world_size, self.padded_numel, self.device
        f32 = dict(dtype=torch.float32, device=dev)
        self.staging = torch.zeros(P, **f32)          # padded fp32 mirror of the bucket (padding stays 0)
        self.work = torch.empty(P, **f32)             # scratch: |x|, x*scale, dequantized values
        self.shard = torch.empty(self.chunk_numel, **f32)  # the owner's fp32 mean
        self.block_amax = torch.empty(W * self.blocks_per_chunk, **f32)
        self.block_scale = torch.empty(W * self.blocks_per_chunk, **f32)
        self.group_amax = torch.empty(self.groups.num_groups, **f32)
        self.group_scale = torch.empty(self.groups.num_groups, **f32)
        u8 = dict(dtype=torch.uint8, device=dev)
        self.send = torch.empty(W, self.chunk_bytes, **u8)
        self.recv = torch.empty(W, self.chunk_bytes, **u8)
        self.gather_in = torch.empty(self.chunk_bytes, **u8)
        self.gather_out = torch.empty(W, self.chunk_bytes, **u8)
        self.residual: Optional[torch.Tensor] = None   # error feedback, allocated on demand
        self.fp8_wire: Optional[torch.Tensor] = None   # nccl_fp8 payload, allocated on demand

    # ------------------------------------------------------------------ views
    @staticmethod
    def payload(packed: torch.Tensor, chunk_numel: int) -> torch.Tensor:
        """The FP8 payload bytes of a packed [rows, chunk_bytes] (or [chunk_bytes]) uint8 buffer."""
        return packed[..., :chunk_numel]

    @staticmethod
    def scales(packed: torch.Tensor, chunk_numel: int) -> torch.Tensor:
        """The fp32 scale_inv values of a packed uint8 buffer, as a float32 view."""
        return packed[..., chunk_numel:].view(torch.float32)

    def ensure_residual(self) -> torch.Tensor:
        """The per-bucket error-feedback residual (padded fp32, zero-initialised)."""
        if self.residual is None:
            self.residual = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        return self.residual

    # ------------------------------------------------------------------ data movement
    def gather_from(self, flat: torch.Tensor) -> torch.Tensor:
        """Copy the bucket's flat gradient into the padded fp32 staging buffer; returns it."""
        for s, d, n in self.copy_runs:
            self.staging[d:d + n].copy_(flat[s:s + n])
        return self.staging

    def scatter_to(self, padded: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Copy a padded fp32 buffer back into the bucket's flat buffer (in its dtype); returns flat."""
        for s, d, n in self.copy_runs:
            flat[s:s + n].copy_(padded[d:d + n])
        return flat

    def segment(self, padded: torch.Tensor, i: int) -> torch.Tensor:
        """The view of parameter i inside a padded buffer."""
        d = self.dst_offsets[i]
        return padded[d:d + self.numels[i]]

    def signature(self) -> tuple:
        """What identifies this geometry: used to detect mismatched layouts across ranks."""
        return (self.world_size, self.block_size, self.scaling, tuple(self.numels))
