"""FSDP1 and FSDP2 with CUDA tensors: two ranks share one GPU through gloo (NCCL refuses two ranks
on one device; FSDP needs world >= 2 for the custom reduce-scatter to run). The GPU codec (auto:
Triton) does the quantization; full gradients are compared with the exact fp64 mean."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

from ddp_checks import CFG0, batch, digest, exact_mean, rel_err  # noqa: E402
from dist_harness import run_world, values  # noqa: E402

DEV = torch.device("cuda", 0)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)).to(DEV)


def _local(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(got, loc):
    names = sorted(loc)
    g = torch.cat([got[n].double().flatten() for n in names])
    r = torch.cat([exact_mean(loc[n]).flatten() for n in names])
    return rel_err(g, r), (g.norm() / r.norm()).item(), digest([got[n] for n in names])


def chk_gpu_fsdp1(rank, W):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from fp8_comm_hook import FP8CommConfig, register_fsdp_hook

    torch.cuda.set_device(DEV)
    out = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        ref = _mlp()
        model = FSDP(copy.deepcopy(ref), sharding_strategy=ShardingStrategy[strategy], use_orig_params=True,
                     device_id=DEV, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        st = register_fsdp_hook(model, FP8CommConfig(**CFG0))
        x, y = (t.to(DEV) for t in batch(rank, 0))
        loc = _local(ref, x, y)
        _local(model, x, y)
        with FSDP.summon_full_params(model, with_grads=True):
            got = {n.replace("_fsdp_wrapped_module.", ""): p.grad.detach().clone() for n, p in model.named_parameters()}
        out[strategy] = (*_compare(got, loc), st.stats()["compressed_buckets"],
                         type(st.codec_for(DEV)).__name__)
    return out


def chk_gpu_fsdp2(rank, W):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from fp8_comm_hook import FP8CommConfig, register_fsdp_hook

    torch.cuda.set_device(DEV)
    ref = _mlp()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cuda", (W,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    st = register_fsdp_hook(model, FP8CommConfig(**CFG0))
    x, y = (t.to(DEV) for t in batch(rank, 0))
    loc = _local(ref, x, y)
    _local(model, x, y)
    # Gather the dim-0 shards by hand: DTensor.full_tensor() (a functional all-gather) crashed a rank
    # with SIGSEGV over gloo with CUDA tensors (torch 2.11), after the backward had completed.
    got = {}
    for n, p in model.named_parameters():
        local = p.grad.to_local().contiguous()
        full = torch.empty((local.shape[0] * W,) + tuple(local.shape[1:]), dtype=local.dtype, device=DEV)
        dist.all_gather_into_tensor(full, local)
        got[n] = full
    return (*_compare(got, loc), st.stats()["compressed_buckets"])


@pytest.fixture(scope="module")
def world_fsdp1():
    return run_world(2, [chk_gpu_fsdp1])


@pytest.fixture(scope="module")
def world_fsdp2():
    return run_world(2, [chk_gpu_fsdp2])


def test_gpu_fsdp2(world_fsdp2):
    per_rank = values(world_fsdp2, "chk_gpu_fsdp2")
    err, ratio, dig, compressed = per_rank[0]
    assert 0.015 < err < 0.035 and abs(ratio - 1) < 0.05 and compressed >= 1
    assert per_rank[1][2] == dig


def test_gpu_fsdp1(world_fsdp1):
    per_rank = values(world_fsdp1, "chk_gpu_fsdp1")
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        err, ratio, dig, compressed, codec = per_rank[0][strategy]
        bound = 0.035 if strategy == "FULL_SHARD" else 0.045
        assert 0.015 < err < bound, (strategy, err)
        assert abs(ratio - 1) < 0.05 and compressed >= 1
        assert per_rank[1][strategy][2] == dig, "ranks disagree"
