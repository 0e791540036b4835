"""A communication worker: one thread that runs buckets' FP8 all-reduces in the order they were handed
to it, so the autograd thread never blocks on the wire.

On gloo every collective is a host-side exchange: the eager hook waits for its all-to-all inside the
backward pass, so the next layers' gradients wait for the network. The worker takes each bucket as
the hook sees it and returns at once with a Future; the bucket's whole algorithm (encode, all-to-all,
reduce, all-gather, decode) runs on the worker thread while autograd goes on. One thread, one queue:
buckets are exchanged in the order DDP hands them over, the same on every rank. The collectives are
issued from this thread, never from a Future callback (gloo can deadlock on collectives issued from
its callbacks once several buckets are in flight), and on a process group of their own, so that they
cannot interleave with collectives the training issues on the data-parallel group meanwhile.
"""
import atexit
import queue
import threading
import weakref
from typing import Callable, Optional

import torch

__all__ = ["CommWorker"]


def _serve(jobs: "queue.SimpleQueue", num_threads: int) -> None:
    """The worker thread's loop: run each job, hand its result or error to its Future; None stops."""
    # Intra-op threads are a per-thread setting in OpenMP builds: a new thread would use every core,
    # oversubscribing a rank pinned to a few. Use what the thread that started the worker uses.
    torch.set_num_threads(num_threads)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, fut, ready = job
        try:
            if ready is None:
                fut.set_result(fn())
                continue
            # CUDA tensors: on the bucket's device (the current device is per thread), after the
            # kernels that wrote the bucket.
            event, device = ready
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).wait_event(event)
                fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - every failure must reach the Future DDP waits on
            fut.set_exception(e)


_LIVE: "weakref.WeakSet[CommWorker]" = weakref.WeakSet()
_EXIT_JOIN_S = 10.0


@atexit.register
def _close_all_at_exit() -> None:
    """At interpreter exit, let every live worker finish its queued jobs and join its thread (up to
    :data:`_EXIT_JOIN_S` each): a daemon thread left inside torch or gloo while C++ statics are torn
    down can abort the process after training has finished."""
    for w in list(_LIVE):
        w.close(join_s=_EXIT_JOIN_S)


class CommWorker:
    """A daemon thread running submitted jobs one after another, in submission order.

    :meth:`submit` returns a Future completed with the job's return value (or its exception). The
    thread starts on the first job and stops when the worker is closed or garbage-collected.
    """

    __slots__ = ("_jobs", "_thread", "name", "__weakref__")

    def __init__(self, name: str = "fp8-comm"):
        self.name = name
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[[], torch.Tensor], device: Optional[torch.device] = None) -> torch.futures.Future:
        """Queue ``fn`` (returning the reduced tensor); returns its Future. With a CUDA ``device``,
        ``fn`` starts only after the work queued so far on the caller's current stream, and the
        Future is CUDA-aware (its users wait for ``fn``'s kernels)."""
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs, torch.get_num_threads()), name=self.name,
                                            daemon=True)
            self._thread.start()
            _LIVE.add(self)
        ready = None
        if device is not None and device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            ready = (ev, device)
            fut = torch.futures.Future(devices=[device])
        else:
            fut = torch.futures.Future()
        self._jobs.put((fn, fut, ready))
        return fut

    def close(self, join_s: Optional[float] = None) -> None:
        """Let the thread finish the queued jobs and stop; with ``join_s``, wait up to that many
        seconds for it to end."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            _LIVE.discard(self)
            if join_s is not None and thread is not threading.current_thread():
                thread.join(join_s)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
