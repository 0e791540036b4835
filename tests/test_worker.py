"""The communication worker (gloo): FP8 buckets run on one thread in bucket order (or alternate
between two, each with its own side group), giving exactly the hook-thread path's results; many buckets in flight at world 3 finish (no deadlock); DDP's own
collectives on the data-parallel group (find_unused_parameters) do not interleave with the worker's."""
import copy
import os
import threading

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_checks import CFG0, batch, digest, local_grads, mlp
from dist_harness import run_world, values
from fp8_comm_hook import FP8CommConfig, register_ddp_hook
from fp8_comm_hook.worker import CommWorker


def _run(worker: bool, steps=4, bucket_cap_mb=0.01, unused=False, workers=1, threads=None, **cfg):
    """Gradients after each step (digests), the stats and whether a worker ran, with the worker on or
    off (``workers``: how many; ``threads``, a list, gets the names of the threads that ran buckets)."""
    os.environ["FP8_COMM_WORKER"] = "1" if worker else "0"
    os.environ["FP8_COMM_WORKERS"] = str(workers)
    try:
        d = DDP(mlp(depth=24, width=160, unused=unused), bucket_cap_mb=bucket_cap_mb, find_unused_parameters=unused)
        st = register_ddp_hook(d, FP8CommConfig(**{**CFG0, **cfg}))
    finally:
        os.environ.pop("FP8_COMM_WORKER", None)
        os.environ.pop("FP8_COMM_WORKERS", None)
    out = []
    for step in range(steps):
        x, y = batch(dist_rank(), step)
        g = local_grads(d, x, y)
        out.append(digest([v for v in g.values() if v is not None]))
    if threads is not None:
        threads.extend(sorted(w.name for w in st._workers if w._thread is not None))
    return out, st.stats(), st.worker is not None


def dist_rank():
    import torch.distributed as dist
    return dist.get_rank()


def chk_worker_matches_hook_thread(rank, W):
    """Many small buckets (>= 15 per step), with and without error feedback: identical gradients and
    stats with the worker and without it."""
    out = {}
    for ef in (False, True):
        on, s_on, used_on = _run(True, error_feedback=ef)
        off, s_off, used_off = _run(False, error_feedback=ef)
        out[ef] = dict(same=on == off, stats_same=s_on == s_off, used=(used_on, used_off),
                       buckets=s_on["compressed_buckets"] // s_on["steps"], digest=on[-1])
    return out


def chk_two_workers_match_hook_thread(rank, W):
    """Two workers (FP8_COMM_WORKERS=2), buckets alternating between them and their two side groups,
    with and without error feedback: the hook thread's gradients and stats, and both threads ran."""
    out = {}
    for ef in (False, True):
        names = []
        two, s_two, used = _run(True, workers=2, threads=names, error_feedback=ef)
        off, s_off, _ = _run(False, error_feedback=ef)
        out[ef] = dict(same=two == off, stats_same=s_two == s_off, used=used, threads=names, digest=two[-1])
    return out


def chk_worker_with_find_unused(rank, W):
    """DDP all-reduces its unused-parameter map on the data-parallel group during backward while the
    worker exchanges buckets on its own group: no hang, same results as without the worker."""
    on, s_on, used = _run(True, unused=True, bucket_cap_mb=0.02)
    off, _, _ = _run(False, unused=True, bucket_cap_mb=0.02)
    return dict(same=on == off, used=used, digest=on[-1])


def chk_stochastic_rounding_keeps_hook_thread(rank, W):
    """Stochastic rounding reseeds one generator per bucket on the hook's thread: no worker then."""
    _, _, used = _run(True, steps=1, stochastic_rounding=True)
    return used


@pytest.fixture(scope="module", params=[3, 4])
def world(request):
    return request.param, run_world(request.param, [chk_worker_matches_hook_thread, chk_worker_with_find_unused,
                                                    chk_stochastic_rounding_keeps_hook_thread,
                                                    chk_two_workers_match_hook_thread])


def test_worker_matches_hook_thread(world):
    W, res = world
    per_rank = values(res, "chk_worker_matches_hook_thread")
    for ef in (False, True):
        for r in per_rank:
            assert r[ef]["same"] and r[ef]["stats_same"], r[ef]
            assert r[ef]["used"] == (True, False)
            assert r[ef]["buckets"] >= 15   # per step, on average (DDP's first step has fewer)
        assert len({r[ef]["digest"] for r in per_rank}) == 1   # bit-identical across ranks


def test_two_workers_match_hook_thread(world):
    W, res = world
    per_rank = values(res, "chk_two_workers_match_hook_thread")
    for ef in (False, True):
        for r in per_rank:
            assert r[ef]["same"] and r[ef]["stats_same"] and r[ef]["used"], r[ef]
            assert r[ef]["threads"] == ["fp8-comm-0", "fp8-comm-1"], r[ef]["threads"]
        assert len({r[ef]["digest"] for r in per_rank}) == 1   # bit-identical across ranks


def test_worker_count_must_be_a_positive_integer(monkeypatch):
    from fp8_comm_hook.ddp import _worker_count
    monkeypatch.setenv("FP8_COMM_WORKERS", "2")
    assert _worker_count() == 2
    monkeypatch.delenv("FP8_COMM_WORKERS")
    assert _worker_count() == 1
    assert _worker_count(torch.device("cpu")) == 1
    assert _worker_count(torch.device("cuda", 0)) == 2   # the default on CUDA (no CUDA call is made)
    monkeypatch.setenv("FP8_COMM_WORKERS", "1")
    assert _worker_count(torch.device("cuda", 0)) == 1
    for bad in ("0", "-1", "two", ""):
        monkeypatch.setenv("FP8_COMM_WORKERS", bad)
        with pytest.raises(ValueError, match="FP8_COMM_WORKERS must be a positive integer"):
            _worker_count()


def test_worker_with_find_unused_parameters(world):
    W, res = world
    per_rank = values(res, "chk_worker_with_find_unused")
    assert all(r["same"] and r["used"] for r in per_rank), per_rank
    assert len({r["digest"] for r in per_rank}) == 1


def test_stochastic_rounding_keeps_hook_thread(world):
    W, res = world
    assert values(res, "chk_stochastic_rounding_keeps_hook_thread") == [False] * W


def test_comm_worker_runs_in_order_on_its_thread_and_reports_errors():
    w = CommWorker()
    seen = []
    futs = [w.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or torch.tensor(i))
            for i in range(50)]
    assert [int(f.wait()) for f in futs] == list(range(50))
    assert [i for i, _ in seen] == list(range(50)) and {n for _, n in seen} == {"fp8-comm"}

    def boom():
        raise RuntimeError("lost link")

    fut = w.submit(boom)
    with pytest.raises(RuntimeError, match="lost link"):
        fut.wait()
    assert int(w.submit(lambda: torch.tensor(7)).wait()) == 7   # the thread survives a failed job
    w.close()


def test_comm_worker_finishes_its_queue_and_joins_at_exit():
    """close(join_s) runs what was queued before it, then the thread ends; the exit handler does the
    same for every live worker, so no worker thread is inside torch while the interpreter ends."""
    import time

    from fp8_comm_hook import worker as wmod

    w = CommWorker(name="fp8-comm-exit")
    done = []
    futs = [w.submit(lambda i=i: (time.sleep(0.02), done.append(i), torch.tensor(i))[2]) for i in range(5)]
    thread = w._thread
    assert w in wmod._LIVE
    wmod._close_all_at_exit()
    assert not thread.is_alive() and done == list(range(5)) and [int(f.wait()) for f in futs] == done
    assert w not in wmod._LIVE and w._thread is None
    w.close(join_s=1.0)   # closing again is a no-op
    assert int(w.submit(lambda: torch.tensor(3)).wait()) == 3   # a closed worker starts a new thread
    w.close(join_s=5.0)


def test_gloo_piece_sizes():
    """Rows go in pieces of 128 KB, and in at most GLOO_MAX_PIECES pieces (4 KB multiples) when that
    makes them larger; the pieces cover every row exactly."""
    from fp8_comm_hook.collectives import GLOO_MAX_PIECES, GLOO_PIECE_BYTES, piece_bytes
    assert piece_bytes(1) == piece_bytes(GLOO_PIECE_BYTES * GLOO_MAX_PIECES) == GLOO_PIECE_BYTES
    for n in (GLOO_PIECE_BYTES * GLOO_MAX_PIECES + 1, 2_228_224, 11_900_000, 190_000_001):
        p = piece_bytes(n)
        assert p % 4096 == 0 and p >= GLOO_PIECE_BYTES
        assert -(-n // p) <= GLOO_MAX_PIECES and -(-n // (p - 4096)) > GLOO_MAX_PIECES, (n, p)
