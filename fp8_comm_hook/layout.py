"""The grad-bucket manager: a padded, block-aligned mirror of one gradient bucket.

For a bucket holding parameters p_0..p_k (contiguous in DDP's flat bucket buffer), the layout places
each parameter on a block boundary of a padded fp32 buffer whose size is a multiple of
``world_size * block_size``, splits that buffer into ``world_size`` equal shards ("chunks"; rank r
owns chunk r), derives the scale groups of the configured scaling mode, and owns every buffer the
wire algorithms reuse each step (the fp32 staging and work buffers, the packed uint8 send, receive
and gather buffers, the scale scratch, the nccl_fp8 wire and the error-feedback residual), all
declared in ``__slots__``. Nothing here depends on the codec backend; codecs keep what they derive
per layout in their own workspaces, keyed by the layout.

Packed chunk format (one per destination, identical size on every rank)::

    [ chunk_numel FP8 payload bytes | groups_per_chunk fp32 scale_inv values ]

``chunk_numel`` is a multiple of ``block_size`` (>= 16), so the scales start 4-byte aligned.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .geometry import ScaleGroups, round_up

__all__ = ["BucketLayout", "PooledLayout", "LayoutSpec", "ScaleGroups"]


class LayoutSpec(NamedTuple):
    """What a layout is built from: a stable key per segment (``names``), their element counts and
    offsets in the flat source buffer; ``world_size``/``rank`` of the group the buffer is reduced
    over (None: the state's group); ``pooled`` for a :class:`PooledLayout` (FSDP). The state caches
    layouts by spec (see :meth:`fp8_comm_hook.state.FP8CommState.layout`)."""

    names: Tuple[str, ...]
    numels: Tuple[int, ...]
    src_offsets: Tuple[int, ...]
    world_size: Optional[int] = None
    rank: Optional[int] = None
    pooled: bool = False

    @classmethod
    def single(cls, name: str, numel: int, pooled: bool = False) -> "LayoutSpec":
        """One segment covering a whole flat buffer of ``numel`` elements."""
        return cls((name,), (int(numel),), (0,), pooled=pooled)

    @classmethod
    def shards(cls, key: str, numel: int, world_size: int, rank: int) -> "LayoutSpec":
        """A flat buffer of ``numel`` elements split into ``world_size`` equal shards, one segment
        each (keyed ``"<key>[r]"``), each padded on its own, so padded chunk r is exactly shard r
        (FSDP's reduce-scatter input); pooled. ``ValueError`` when ``numel`` does not split evenly."""
        if numel % world_size:
            raise ValueError(f"flat gradient of {numel} elements does not split into {world_size} equal shards")
        c = numel // world_size
        return cls(tuple(f"{key}[{r}]" for r in range(world_size)), (c,) * world_size,
                   tuple(r * c for r in range(world_size)), world_size, rank, True)


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

    __slots__ = (
        # geometry
        "world_size", "rank", "block_size", "scaling", "src_numel", "dtype", "device", "names", "numels",
        "src_offsets", "dst_offsets", "data_numel", "padded_numel", "chunk_numel", "blocks_per_chunk", "copy_runs",
        "groups", "chunk_bytes", "own_groups", "own_groups_all_sources",
        # buffers reused every step (see _alloc)
        "staging", "work", "shard", "block_amax", "block_scale", "group_amax", "group_scale", "send", "recv",
        "gather_in", "gather_out",
        # allocated on first use: error feedback, the FP8 sum's wire, its shared scales and its output shard
        "residual", "fp8_wire", "fp8_scale_inv", "fp8_out",
        # the automatic pre_scale of an FP8 sum: this step's factor, the last sum's saturation count
        # (on the device) and its copy on the host with the event that says the copy is complete
        "auto_pre_scale", "saturated_last", "saturated_host", "saturated_ready",
        # pinned host copies of the packed buffers, for CUDA buckets exchanged over gloo in pieces
        "host_mirrors",
        "__weakref__",
    )

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
            pos += round_up(n, block_size)
        self.data_numel = pos
        self.padded_numel = max(round_up(pos, world_size * block_size), world_size * block_size)
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
        self.residual: Optional[torch.Tensor] = None       # error feedback: ensure_residual()
        self.fp8_wire: Optional[torch.Tensor] = None       # FP8 sum payload [W, chunk]: ensure_fp8_sum()
        self.fp8_scale_inv: Optional[torch.Tensor] = None  # FP8 sum shared scale_inv: ensure_fp8_sum()
        self.fp8_out: Optional[torch.Tensor] = None        # FP8 reduce-scatter output shard: ensure_fp8_sum()
        self.auto_pre_scale: Optional[float] = None
        self.saturated_last: Optional[torch.Tensor] = None
        self.saturated_host: Optional[torch.Tensor] = None
        self.saturated_ready = None
        self.host_mirrors: Dict[str, torch.Tensor] = {}

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

    def ensure_fp8_sum(self, scatter: bool = False) -> None:
        """Allocate the buffers of an FP8 sum (``nccl_fp8``): the [W, chunk] uint8 wire and the shared
        scale_inv; with ``scatter``, also the uint8 output shard of its reduce-scatter form."""
        if self.fp8_wire is None:
            self.fp8_wire = torch.empty(self.world_size, self.chunk_numel, dtype=torch.uint8, device=self.device)
        if self.fp8_scale_inv is None:
            self.fp8_scale_inv = torch.empty(self.groups.num_groups, dtype=torch.float32, device=self.device)
        if scatter and self.fp8_out is None:
            self.fp8_out = torch.empty(self.chunk_numel, dtype=torch.uint8, device=self.device)

    def host_mirror(self, name: str) -> torch.Tensor:
        """A pinned host tensor shaped like the packed buffer ``name`` ("send", "recv", "gather_in"
        or "gather_out"), allocated on first use: where a CUDA bucket's bytes are staged for gloo's
        point-to-point pieces (gloo sends and receives host memory only)."""
        h = self.host_mirrors.get(name)
        if h is None:
            t = getattr(self, name)
            h = self.host_mirrors[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return h

    # ------------------------------------------------------------------ the automatic pre_scale's state
    def set_auto_pre_scale(self, pre_scale: float) -> float:
        """Record this step's automatic pre_scale; returns it."""
        self.auto_pre_scale = float(pre_scale)
        return self.auto_pre_scale

    def saturation_buffer(self) -> torch.Tensor:
        """The device int64 scalar an FP8 sum writes its saturation count into (allocated once, so a
        captured CUDA graph writes the same memory every replay)."""
        if self.saturated_last is None:
            self.saturated_last = torch.zeros((), dtype=torch.int64, device=self.device)
        return self.saturated_last

    def publish_saturation(self) -> None:
        """Start copying the saturation count to the host (CUDA: a non-blocking copy into pinned
        memory and an event), so that the next step reads it without stalling the stream."""
        if self.device.type != "cuda" or self.saturated_last is None:
            return
        if self.saturated_host is None:
            self.saturated_host = torch.zeros((), dtype=torch.int64, pin_memory=True)
            self.saturated_ready = torch.cuda.Event()
        self.saturated_host.copy_(self.saturated_last, non_blocking=True)
        self.saturated_ready.record()

    def last_saturation(self) -> Optional[int]:
        """The saturation count of the last FP8 sum (None before the first). On CUDA it waits only for
        the copy :meth:`publish_saturation` started, which finished with the last step."""
        if self.saturated_ready is not None:
            self.saturated_ready.synchronize()
            return int(self.saturated_host)
        if self.saturated_last is None:
            return None
        return int(self.saturated_last.item())

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


class PooledLayout(BucketLayout):
    """A :class:`BucketLayout` whose large buffers (fp32 staging, work and shard buffers, packed send,
    recv and gather, the FP8 wire and output shard) are views into a pool shared by every layout of
    one state, bound before each use with :meth:`bind`; the small per-block scale buffers stay its own.

    FSDP frees each unit's unsharded gradient after reducing it; per-unit persistent buffers would
    cost about 11 bytes per unsharded element of *every* unit. Sharing costs that for the largest
    unit only. Units are reduced one after another on one stream (FSDP1's post-backward stream,
    FSDP2's reduce-scatter stream), so one set of buffers serves them all.
    """

    __slots__ = ("_specs", "_padding")

    POOLED = ("staging", "work", "shard", "send", "recv", "gather_in", "gather_out", "fp8_wire", "fp8_out")
    #: The pooled buffers each algorithm uses: the reduce-scatters (``rs_*``) and the NO_SHARD
    #: all-reduces (``ar_*``).
    BUFFERS = {
        "rs_two_shot": ("staging", "work", "shard", "send", "recv"),
        "rs_nccl_fp8": ("staging", "work", "fp8_wire", "fp8_out"),
        "ar_two_shot": ("staging", "work", "shard", "send", "recv", "gather_in", "gather_out"),
        "ar_nccl_fp8": ("staging", "work", "fp8_wire"),
    }

    def _alloc(self) -> None:
        real = self.device
        self.device = torch.device("meta")      # record shapes without allocating
        try:
            super()._alloc()
        finally:
            self.device = real
        self._specs: Dict[str, Tuple[tuple, torch.dtype]] = {
            "fp8_wire": ((self.world_size, self.chunk_numel), torch.uint8),
            "fp8_out": ((self.chunk_numel,), torch.uint8)}
        for name in BucketLayout.__slots__:
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor) and t.is_meta:
                if name in self.POOLED:
                    self._specs[name] = (tuple(t.shape), t.dtype)
                    setattr(self, name, None)
                else:
                    setattr(self, name, torch.zeros(t.shape, dtype=t.dtype, device=real))
        self.fp8_scale_inv = torch.empty(self.groups.num_groups, dtype=torch.float32, device=real)
        # Padding of the staging buffer (must read as zeros; the pool holds other units' data there).
        pad, pos = [], 0
        for _, d, n in sorted(self.copy_runs, key=lambda r: r[1]):
            if d > pos:
                pad.append((pos, d))
            pos = max(pos, d + n)
        if pos < self.padded_numel:
            pad.append((pos, self.padded_numel))
        self._padding = pad

    def ensure_fp8_sum(self, scatter: bool = False) -> None:
        """Nothing to allocate: the FP8 sum's buffers come from the pool (:meth:`bind`)."""

    def bind(self, pool: dict, algorithm: str) -> "PooledLayout":
        """Point the buffers ``algorithm`` (a key of :attr:`BUFFERS`) uses at views of ``pool``
        ((name, dtype, device) -> tensor, grown as needed) and zero the staging buffer's padding;
        returns self."""
        names = self.BUFFERS[algorithm]
        for name in names:
            shape, dtype = self._specs[name]
            numel = 1
            for n in shape:
                numel *= n
            key = (name, dtype, self.device)
            buf = pool.get(key)
            if buf is None or buf.numel() < numel:
                buf = pool[key] = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            setattr(self, name, buf[:numel].view(shape))
        if "staging" in names:
            for a, b in self._padding:
                self.staging[a:b].zero_()
        return self
