"""Helpers shared by the codec tests: seeded data and an fp64 model of the wire format."""
import torch

from fp8_comm_hook.codec import TorchCodec
from fp8_comm_hook.formats import get_format
from fp8_comm_hook.layout import BucketLayout


def data(kind: str, n: int, seed: int) -> torch.Tensor:
    """Seeded test data: "gauss", "student_t" (df=3, heavy tails) or "outliers" (Gaussian with 0.1%
    of values times 1e3)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=g)
    if kind == "student_t":
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi = torch.randn(n, 3, generator=g, dtype=torch.float64).pow(2).sum(1)
        return (z / (chi / 3).sqrt()).float()
    if kind == "outliers":
        x = torch.randn(n, generator=g)
        idx = torch.randint(0, n, (max(1, n // 1000),), generator=g)
        x[idx] *= 1e3
        return x
    raise ValueError(kind)


def make_layout(numels, world_size=1, rank=0, block_size=128, scaling="block", dtype=torch.float32):
    offs, pos = [], 0
    for n in numels:
        offs.append(pos)
        pos += n
    return BucketLayout(numels, offs, [f"p{i}" for i in range(len(numels))], world_size, rank, block_size,
                        scaling, pos, dtype, "cpu")


def encode_decode(x: torch.Tensor, numels, fmt="e4m3", scaling="block", block_size=128, world_size=1):
    """Quantize the flat ``x`` into a layout's send buffer and dequantize it back (no network)."""
    L = make_layout(numels, world_size=world_size, block_size=block_size, scaling=scaling, dtype=x.dtype)
    codec = TorchCodec(get_format(fmt))
    codec.encode(x, L)
    C = L.chunk_numel
    out = torch.empty(L.padded_numel)
    codec.dequantize(L.payload(L.send, C), L.scales(L.send, C), L.groups, out, L.block_scale)
    y = torch.empty_like(x)
    L.scatter_to(out, y)
    return L, y


def reference_group_amax(L, x: torch.Tensor) -> torch.Tensor:
    """fp64 amax per scale group, computed independently from the layout's description."""
    padded = torch.zeros(L.padded_numel, dtype=torch.float64)
    for s, d, n in zip(L.src_offsets, L.dst_offsets, L.numels):
        padded[d:d + n] = x[s:s + n].double()
    blocks = padded.abs().view(-1, L.block_size).amax(1)
    if L.groups.block_group is None:
        return blocks
    out = torch.zeros(L.groups.num_groups, dtype=torch.float64)
    return out.scatter_reduce(0, L.groups.block_group, blocks, "amax")
