"""A peer that dies mid-step makes the others raise (within the group's timeout), never hang; a
failed collective leaves the user's gradients as they were."""
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT_S = 10


def _rank(rank, world, store_path, out_dir):
    torch.set_num_threads(1)
    from ddp_checks import batch, mlp
    from fp8_comm_hook import FP8CommConfig, register_ddp_hook
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    d = DDP(mlp(), bucket_cap_mb=0.02)
    register_ddp_hook(d, FP8CommConfig(min_compress_numel=0))
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(d(x), y).backward()  # one healthy step
    if rank == world - 1:
        os._exit(3)  # dies before the second step's collectives
    t0 = time.monotonic()
    try:
        nn.functional.cross_entropy(d(x), y).backward()
        msg = "no error"
    except Exception as e:  # gloo raises on a closed peer or at the timeout
        msg = f"{type(e).__name__}: {str(e)[:200]}"
    with open(os.path.join(out_dir, f"r{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - t0:.2f}\n{msg}")
    os._exit(0)  # the group is broken: leave without a collective teardown


def test_dead_peer_raises_not_hangs():
    world = 3
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(d, "store"), d)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, "a surviving rank hung past the timeout"
        assert procs[-1].exitcode == 3
        for r in range(world - 1):
            elapsed, msg = open(os.path.join(d, f"r{r}.txt")).read().split("\n", 1)
            assert msg != "no error", f"rank {r} did not notice the dead peer"
            assert float(elapsed) < TIMEOUT_S * 3, (r, elapsed, msg)
