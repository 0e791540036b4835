"""A DDP bucket's whole FP8 all-reduce as one captured CUDA graph, replayed on a communication stream.

On CUDA the eager hook spends about a millisecond of host time per bucket (Python, three kernel
launches with many arguments, two collectives' Python paths, the statistics ops) while the device
needs far less, so a backward pass waits on the host. A bucket's buffers are fixed per layout (the
layout's own buffers, DDP's bucket buffer, the residual), so everything the algorithm launches —
codec kernels, both NCCL collectives, the non-finite count — can be captured once and replayed with
one host call. The graph runs the same kernels on the same buffers, so the bytes and the mean are
exactly the eager path's.

The replay goes to a dedicated stream that first waits for the compute stream (the gradients are
ready), while the backward of the next layers keeps running on the compute stream. The Future handed
to DDP is a plain completed one (a CUDA-aware Future records events on every call: ~40 µs of host
time per bucket inside a backward on the H200's host); instead, the step's last bucket makes the
compute stream wait for the communication stream (:meth:`BucketGraphs.join`), so everything after
the backward's last bucket — DDP's copies out of the buckets, the optimizer — sees the means.

Used only where it is exact and safe: CUDA tensors with an NCCL group (gloo collectives run on the
host and cannot be captured), round-to-nearest (stochastic rounding draws a new seed each step), DDP's
own bucket buffers (``all_reduce`` gets new tensors every call) and non-pooled layouts (FSDP rebinds its pooled
buffers). A bucket runs eagerly the first time (compiling kernels, building workspaces) and is
captured the next time. ``nccl_fp8``'s automatic ``pre_scale`` is adapted on the host before each
step (from the last sum's saturation count, copied to the host without stalling the stream) and
selects one graph per value it takes; it steadies at 1 or a halving of it. ``FP8_COMM_CUDA_GRAPHS=0`` turns graphs off (for debugging; logged).
"""
import logging
import weakref
from typing import Callable, Dict, Optional

import torch

from .config import env_switch

__all__ = ["BucketGraphs", "graphs_enabled"]

log = logging.getLogger("fp8_comm_hook")

_ENV = "FP8_COMM_CUDA_GRAPHS"
_EventBase = getattr(torch._C, "_CudaEventBase", None)   # CPU-only builds define it without methods
_record = getattr(_EventBase, "record", None) or torch.cuda.Event.record
_wait = getattr(_EventBase, "wait", None) or torch.cuda.Event.wait


def graphs_enabled() -> bool:
    """False when the environment variable ``FP8_COMM_CUDA_GRAPHS`` is "0" (graphs are on by default)."""
    return env_switch(_ENV)


class BucketGraphs:
    """The captured graphs of one state's buckets and the stream they replay on.

    :meth:`run` replays the graph of (layout, bucket buffer, variant) or, the first time, runs the
    algorithm eagerly, and the second time captures it; returns the Future DDP waits on.
    """

    __slots__ = ("_graphs", "_seen", "_streams", "_events", "_done", "_compute", "_pending", "_logged", "enabled")

    #: Graphs kept per layout (variants: buffers, error feedback, nccl_fp8's pre_scale values); past
    #: it, new variants run eagerly.
    MAX_VARIANTS = 32

    def __init__(self):
        # layout -> {key: CUDAGraph}; dropped with the layout (its buffers are what the graph points at).
        self._graphs: "weakref.WeakKeyDictionary[object, Dict[tuple, torch.cuda.CUDAGraph]]" = \
            weakref.WeakKeyDictionary()
        self._seen: "weakref.WeakKeyDictionary[object, set]" = weakref.WeakKeyDictionary()
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}
        self._events: Dict[torch.device, torch.cuda.Event] = {}
        self._done: Dict[torch.device, torch.cuda.Event] = {}   # recorded on the comm stream by join()
        self._pending: set = set()   # devices whose communication stream has work no join() has covered
        self._compute: Dict[int, torch.cuda.Stream] = {}   # stream id -> Stream object of a compute stream
        self._logged = False
        self.enabled = graphs_enabled()   # read once: the hook path does not look at the environment
        if not self.enabled:
            log.info("fp8_comm_hook: %s=0: CUDA graphs off, buckets run eagerly", _ENV)

    def captured(self) -> int:
        """How many graphs are captured (one per bucket buffer and variant of live layouts)."""
        return sum(len(g) for g in self._graphs.values())

    def _first_runs(self, layout, key, comm, algorithm, prepare_capture) -> bool:
        """Eager the first time ``key`` is seen; captured (then replayed) the second time, unless the
        layout already has :attr:`MAX_VARIANTS` graphs (then eager). Returns whether it replayed."""
        seen = self._seen.setdefault(layout, set())
        if key not in seen or len(self._graphs.get(layout, ())) >= self.MAX_VARIANTS:
            seen.add(key)
            algorithm()
            return False
        if prepare_capture is not None:
            prepare_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=comm, capture_error_mode="thread_local"):
            algorithm()
        self._graphs.setdefault(layout, {})[key] = graph
        if not self._logged:
            self._logged = True
            log.info("fp8_comm_hook: buckets run as captured CUDA graphs on a communication stream "
                     "(%s=0 turns this off)", _ENV)
        graph.replay()
        return True

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The communication stream of ``device`` (created once)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def run(self, layout, flat: torch.Tensor, variant: tuple, algorithm: Callable[[], torch.Tensor],
            on_replay: Callable[[], None], prepare_capture: Optional[Callable[[], None]] = None,
            after_replay: Optional[Callable[[], None]] = None) -> torch.futures.Future:
        """Run ``algorithm()`` (the bucket's synchronous all-reduce, leaving the mean in ``flat``) on
        the communication stream after the compute stream's pending work: eagerly the first time
        this (``layout``, ``flat``, ``variant``) is seen, captured into a CUDA graph and replayed from
        then on. ``layout`` is any object the graphs live and die with (weakly referenced). A replay
        does none of ``algorithm``'s host work: ``on_replay()`` runs instead (host counters).
        ``prepare_capture()`` runs once before capturing (to allocate what the graph must not);
        ``after_replay()`` after every replay, on the communication stream (to queue copies the host
        reads later). Returns a completed Future holding ``flat``, whose values are ready on the
        compute stream only after :meth:`join` (the step's last bucket calls it)."""
        replay = self.replayer(layout, flat, variant, on_replay, after_replay)
        if replay is not None:
            return replay()
        device = flat.device
        key = (flat.data_ptr(), flat.numel(), variant)
        # The hook's host cost is the point here, so streams are switched with the raw calls that
        # torch.cuda.stream() makes, without its per-call checks.
        sid, didx, dtype = torch._C._cuda_getCurrentStream(device.index)
        compute = self._compute.get(sid)
        if compute is None:
            compute = self._compute[sid] = torch.cuda.Stream(stream_id=sid, device_index=didx, device_type=dtype)
        comm = self.stream(device)
        ready = self._events.get(device)
        if ready is None:
            ready = self._events[device] = torch.cuda.Event()
        _record(ready, compute)   # torch.cuda.Event.record / Stream.wait_event without their Python layers
        _wait(ready, comm)
        self._pending.add(device)
        torch._C._cuda_setStream(stream_id=comm.stream_id, device_index=comm.device_index,
                                 device_type=comm.device_type)
        try:
            replayed = self._first_runs(layout, key, comm, algorithm, prepare_capture)
            # An eager run allocates on the communication stream; DDP's buffer must not be handed
            # to the compute stream's allocations while that may still read it.
            flat.record_stream(comm)
            if replayed and after_replay is not None:
                after_replay()
        finally:
            torch._C._cuda_setStream(stream_id=sid, device_index=didx, device_type=dtype)
        fut = torch.futures.Future()
        fut.set_result(flat)
        return fut

    def replayer(self, layout, flat: torch.Tensor, variant: tuple, on_replay: Callable[[], None],
                 after_replay: Optional[Callable[[], None]] = None) -> Optional[Callable[[], torch.futures.Future]]:
        """Once the graph of (``layout``, ``flat``, ``variant``) is captured: a callable doing what
        :meth:`run` does for it, with every lookup done here, once (the graph, the streams, the
        event); None before. The caller keeps it as long as it keeps ``layout``."""
        per_layout = self._graphs.get(layout)
        graph = per_layout.get((flat.data_ptr(), flat.numel(), variant)) if per_layout is not None else None
        if graph is None:
            return None
        device, idx = flat.device, flat.device.index
        comm, ready, computes, pending = self.stream(device), self._events[device], self._compute, self._pending
        comm_id, comm_idx, comm_type = comm.stream_id, comm.device_index, comm.device_type
        get_stream, set_stream, replay = torch._C._cuda_getCurrentStream, torch._C._cuda_setStream, graph.replay
        # One completed Future for every replay: it always holds the same tensor, DDP only reads its
        # value, and creating and completing one costs the hook a few microseconds per bucket.
        done = torch.futures.Future()
        done.set_result(flat)

        def run_replay() -> torch.futures.Future:
            sid, didx, dtype = get_stream(idx)
            compute = computes.get(sid)
            if compute is None:
                compute = computes[sid] = torch.cuda.Stream(stream_id=sid, device_index=didx, device_type=dtype)
            _record(ready, compute)
            _wait(ready, comm)
            pending.add(device)
            set_stream(stream_id=comm_id, device_index=comm_idx, device_type=comm_type)
            try:
                replay()
                if after_replay is not None:
                    after_replay()
            finally:
                set_stream(stream_id=sid, device_index=didx, device_type=dtype)
            on_replay()
            return done

        return run_replay

    def join(self) -> None:
        """Make the current (compute) stream of every device with communication since the last join
        wait for everything queued on its communication stream so far. The DDP hook calls it at the
        step's last bucket, before DDP reads the buckets."""
        if not self._pending:
            return
        for device in self._pending:
            done = self._done.get(device)
            if done is None:
                done = self._done[device] = torch.cuda.Event()
            done.record(self._streams[device])
            torch.cuda.current_stream(device).wait_event(done)
        self._pending.clear()
