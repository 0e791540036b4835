"""Run many checks inside one spawned gloo world, so torch start-up is paid once per world.

``run_world(world_size, checks)`` spawns ``world_size`` processes over a FileStore, runs every check
(a module-level function ``fn(rank, world_size) -> value``) in order on every rank, and returns
``{check_name: [(ok, value_or_traceback) per rank]}``. A barrier after each check keeps the ranks in
step; a check that fails on one rank is reported, and the next check still runs.
"""
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 60


def _worker(rank, world_size, store_path, checks, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    results = {}
    for name, fn in checks:
        try:
            results[name] = (True, fn(rank, world_size))
        except Exception:
            results[name] = (False, traceback.format_exc())
        try:
            dist.barrier()
        except Exception:
            results[name + ":barrier"] = (False, traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    # Leave together, synchronised through the store rather than gloo: a rank that closes its gloo
    # sockets while a peer is still finishing the last barrier makes that peer abort.
    store.add("done", 1)
    deadline = time.monotonic() + PG_TIMEOUT_S
    while int(store.add("done", 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()


def run_world(world_size, checks):
    """Run ``checks`` (list of functions) on a fresh gloo world; see the module docstring."""
    named = [(fn.__name__, fn) for fn in checks]
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        mp.spawn(_worker, args=(world_size, store, named, d), nprocs=world_size, join=True)
        per_rank = []
        for r in range(world_size):
            with open(os.path.join(d, f"rank{r}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    return {name: [per_rank[r].get(name, (False, "missing")) for r in range(world_size)] for name, _ in named}


def values(results, name):
    """The per-rank values of check ``name``; raises AssertionError with the traceback if any rank failed."""
    per_rank = results[name]
    for r, (ok, v) in enumerate(per_rank):
        if not ok:
            raise AssertionError(f"check {name} failed on rank {r}:\n{v}")
    return [v for _, v in per_rank]
