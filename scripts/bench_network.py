"""DDP step time over an emulated multi-node cluster with rate-limited links: where FP8 gradients pay.

A node is a Linux network namespace; its ranks talk over the namespace's loopback; nodes talk over
veth pairs joined by a bridge, each veth shaped with ``tc tbf`` at both ends (into and out of the
node) to the link rate. Traffic between nodes crosses a real kernel TCP path at that rate.

For every link rate (``--rates``, Gbit/s; ``none`` = unshaped) a fresh world of ``--nodes`` x
``--ranks-per-node`` gloo ranks first checks the shaping (a plain fp32 all-reduce's bus bandwidth,
2(W-1)/W x bytes / time, printed against the set rate), then times the DDP training step (forward,
backward, SGD step; median over ``--steps`` after ``--warmup``, each step's time the slowest rank's)
of each model in every mode, the modes' steps interleaved so drifts of the machine fall on all alike:

- ``fp32``: DDP's own all-reduce; ``bf16``: the bf16 hook (``register_grad_comm(model, "bf16")``);
- ``fp8``: FP8 ``two_shot``; ``fp8_ef``: the same with error feedback; ``auto``: ``algorithm="auto"``
  (per bucket FP8 or the plain all-reduce, from figures measured at registration; its choices are
  stored with its rows). FP8 modes use the config's defaults otherwise.

Every rank is pinned to ``--threads-per-rank`` cores (default: the machine's cores split evenly
between the ranks, as a node's ranks split its cores). Ranks run on CPU or, with ``--device cuda``, as
CUDA ranks sharing one GPU through gloo (NCCL refuses two ranks on one GPU). Models: ``--model mlp``
(``--depth`` layers of Linear(width, width) + ReLU; several depths give several models) or ``--model
charlm`` (the trainer's byte-level transformer, scripts/train.py's CharGPT, scaled by ``--d-model``
and ``--n-layer``).

Needs root and ``ip``, ``tc`` and ``nsenter``. Everything it creates (namespaces ``fnb<pid>n<i>``,
veths ``fnb<pid>h<i>``, bridge ``fnb<pid>br``, addresses of a private /24 checked to be unused on this
machine, used only inside those namespaces) is removed at the end, also after a failed rank, Ctrl-C
or SIGTERM. Writes ``<out>.json`` ({"rows": [{"nodes", "ranks_per_node", "rate_gbit" (None =
unshaped), "measured_busbw_gbit", "model", "numel", "mode", "step_ms", ...}], ...metadata};
``--append`` merges into an existing file) and ``<out>.png`` (speed-up over the bf16 hook against
link rate, one line per mode); prints a table with each mode's ratio to the bf16 hook.

    sudo python scripts/bench_network.py --nodes 2 --ranks-per-node 1 --model mlp --width 1024 --depth 4 12 \\
        --rates 0.2 1 none --out benchmarks/results/network-cpu
    python scripts/bench_network.py --device cuda --nodes 4 --ranks-per-node 1 --width 2048 --depth 11 \\
        --rates 2.5 5 10 none --out benchmarks/results/network-h200
"""
import argparse
import ipaddress
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the launcher imports the package too (a checkout need not be installed)
    sys.path.insert(0, ROOT)
MODES = ("fp32", "bf16", "fp8", "fp8_ef", "auto")
LABELS = {"fp32": "fp32", "bf16": "bf16 hook", "fp8": "fp8 two_shot", "fp8_ef": "fp8 + EF", "auto": "auto"}


# ====================================================================================== the cluster
class SetupError(RuntimeError):
    """The emulated cluster cannot be built here (not root, a tool missing, no free subnet)."""


def require_tools() -> None:
    """Raise :class:`SetupError` naming what is missing: root, ``ip``, ``tc``, ``nsenter``."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and tc need it; run with sudo)")
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            missing.append(f"'{tool}' ({'util-linux' if tool == 'nsenter' else 'iproute2'})")
    if missing:
        raise SetupError("bench_network needs " + ", ".join(missing))


def _run(argv, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SetupError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _used_networks():
    """IPv4 networks in use on this machine: addresses and routes of the root namespace and the
    addresses of every existing namespace."""
    nets = []
    texts = [_run(["ip", "-4", "-o", "addr", "show"], check=False).stdout,
             _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout]
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        if line.split():
            texts.append(_run(["ip", "-n", line.split()[0], "-4", "-o", "addr", "show"], check=False).stdout)
    for text in texts:
        for tok in text.split():
            if tok[0].isdigit() and ("/" in tok or tok.count(".") == 3):
                try:
                    nets.append(ipaddress.ip_network(tok, strict=False))
                except ValueError:
                    pass
    return nets


def pick_subnet(used=None) -> ipaddress.IPv4Network:
    """A private /24 that overlaps no network in use here (10.231-239.x.0/24, then 172.30-31.x.0/24)."""
    used = _used_networks() if used is None else used
    for second in list(range(231, 240)):
        for third in range(0, 256, 7):
            net = ipaddress.ip_network(f"10.{second}.{third}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
    for second in (30, 31):
        for third in range(256):
            net = ipaddress.ip_network(f"172.{second}.{third}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
    raise SetupError("no unused private /24 found for the emulated cluster")


class Cluster:
    """``nodes`` network namespaces joined by shaped veths through a bridge. Everything made is
    recorded as it is made and removed by :meth:`down` (safe to call at any point, more than once)."""

    def __init__(self, nodes: int, tag: str = None):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        tag = tag or f"fnb{os.getpid()}"
        self.nodes = nodes
        self.bridge = f"{tag}br"
        self.netns = [f"{tag}n{i}" for i in range(nodes)]
        self.host_veth = [f"{tag}h{i}" for i in range(nodes)]
        self.node_veth = [f"{tag}c{i}" for i in range(nodes)]
        self.subnet = None
        self.addrs = []
        self._made = []  # ("netns" | "link", name), in creation order

    def up(self) -> "Cluster":
        self.subnet = pick_subnet()
        hosts = list(self.subnet.hosts())
        self.addrs = [str(hosts[i]) for i in range(self.nodes)]
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made.append(("link", self.bridge))
        _run(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.nodes):
            ns, h, c = self.netns[i], self.host_veth[i], self.node_veth[i]
            _run(["ip", "netns", "add", ns])
            self._made.append(("netns", ns))
            _run(["ip", "link", "add", h, "type", "veth", "peer", "name", c])
            self._made.append(("link", h))
            _run(["ip", "link", "set", c, "netns", ns])
            _run(["ip", "link", "set", h, "master", self.bridge])
            _run(["ip", "link", "set", h, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addrs[i]}/{self.subnet.prefixlen}", "dev", c])
            _run(["ip", "-n", ns, "link", "set", c, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        return self

    def shape(self, rate_gbit) -> None:
        """Limit every node's link to ``rate_gbit`` Gbit/s in both directions (``tc tbf`` on both
        ends of its veth); None removes the limits."""
        for i in range(self.nodes):
            for prefix, dev in ((["tc"], self.host_veth[i]), (["tc", "-n", self.netns[i]], self.node_veth[i])):
                _run(prefix + ["qdisc", "del", "dev", dev, "root"], check=False)
                if rate_gbit is not None:
                    mbit = rate_gbit * 1000
                    # a burst of 2 ms at the rate, never below 128 KB (GSO packets reach 64 KB)
                    burst = max(128 * 1024, int(mbit * 1e6 / 8 * 2e-3))
                    _run(prefix + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
                                   "burst", str(burst), "latency", "100ms"])

    def command(self, node: int, argv) -> list:
        """``argv`` run inside node ``node``'s network namespace."""
        return ["nsenter", f"--net=/var/run/netns/{self.netns[node]}"] + list(argv)

    def down(self) -> list:
        """Remove everything this cluster made (namespaces first: that removes their veth ends);
        returns the removals that failed (empty when all is gone)."""
        failed = []
        for kind, name in reversed(self._made):
            if kind == "netns":
                p = _run(["ip", "netns", "del", name], check=False)
            else:
                p = _run(["ip", "link", "del", name], check=False)
                if p.returncode != 0 and "Cannot find device" in p.stderr:  # went with its namespace
                    continue
            if p.returncode != 0:
                failed.append(f"{kind} {name}: {p.stderr.strip()}")
        self._made = []
        return failed

    def leftovers(self) -> list:
        """Namespaces and links of this cluster that still exist."""
        ns = _run(["ip", "netns", "list"], check=False).stdout.split()
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        left = [n for n in self.netns if n in ns]
        left += [l for l in [self.bridge] + self.host_veth if f" {l}:" in links or f" {l}@" in links]
        return left


class MPS:
    """``--mps``: an NVIDIA MPS control daemon of its own (pipe and log folders in a temporary
    directory), so that the CUDA ranks sharing the one GPU run their kernels side by side, as ranks
    on GPUs of their own do, instead of taking turns in time slices between their contexts (a rank's
    codec then waits for the other ranks' slices). Ranks started after :meth:`start` inherit its
    environment; :meth:`stop` quits the daemon and removes the folders (safe to call more than once)."""

    def __init__(self):
        self.exe, self.dir, self.env = None, None, {}

    def start(self) -> "MPS":
        self.exe = exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            raise SetupError("--mps needs 'nvidia-cuda-mps-control' (the NVIDIA driver's utilities) on PATH")
        self.dir = tempfile.mkdtemp(prefix="bench_network_mps_")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}
        for d in self.env.values():
            os.makedirs(d)
        p = subprocess.run([exe, "-d"], env=dict(os.environ, **self.env), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True)
        if p.returncode != 0:
            self.stop()
            raise SetupError(f"nvidia-cuda-mps-control -d failed ({p.returncode}): {p.stderr.strip()}")
        os.environ.update(self.env)
        return self

    def stop(self) -> None:
        if self.dir is None:
            return
        if os.path.exists(os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "control")):
            try:
                subprocess.run([self.exe], input="quit\n", env=dict(os.environ, **self.env), capture_output=True,
                               text=True, timeout=30)
            except subprocess.TimeoutExpired:
                print(f"WARNING: the MPS daemon of {self.dir} did not quit within 30 s", file=sys.stderr)
        for k in self.env:
            os.environ.pop(k, None)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


# ====================================================================================== one world
class _Terminate(Exception):
    pass


def _raise_terminate(signum, frame):
    raise _Terminate(f"signal {signum}")


def run_world(cluster: Cluster, ranks_per_node: int, spec: dict, timeout_s: float = 3600.0,
              verbose: bool = True) -> dict:
    """Start ``cluster.nodes * ranks_per_node`` worker ranks (this script with ``--worker``) in the
    nodes' namespaces and wait for them; returns rank 0's result. A failed rank stops the others
    and raises ``RuntimeError`` with the tail of its log; so does the timeout."""
    world = cluster.nodes * ranks_per_node
    procs = []
    with tempfile.TemporaryDirectory(prefix="bench_network_") as tmp:
        spec = dict(spec, world=world, store=os.path.join(tmp, "store"), result=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=str(spec["threads_per_rank"]))
        try:
            for node in range(cluster.nodes):
                for local in range(ranks_per_node):
                    rank = node * ranks_per_node + local
                    log_path = os.path.join(tmp, f"rank{rank}.log")
                    out = None if (rank == 0 and verbose) else open(log_path, "w")
                    argv = cluster.command(node, [sys.executable, os.path.abspath(__file__), "--worker", spec_path,
                                                  "--rank", str(rank)])
                    procs.append((rank, log_path, subprocess.Popen(
                        argv, env=dict(env, GLOO_SOCKET_IFNAME=cluster.node_veth[node]), stdout=out,
                        stderr=subprocess.STDOUT if out else None, start_new_session=True)))
                    if out is not None:
                        out.close()
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [(r, lp, p.poll()) for r, lp, p in procs]
                bad = [(r, lp, c) for r, lp, c in codes if c not in (None, 0)]
                if bad:
                    r, lp, c = bad[0]
                    tail = ""
                    if os.path.exists(lp):
                        with open(lp) as f:
                            tail = "".join(f.readlines()[-30:])
                    raise RuntimeError(f"rank {r} exited with {c}" + (f"; its log ends:\n{tail}" if tail else ""))
                if all(c == 0 for _, _, c in codes):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the world did not finish within {timeout_s:.0f} s")
                time.sleep(0.2)
            with open(spec["result"]) as f:
                return json.load(f)
        finally:
            _stop(p for _, _, p in procs)


def _stop(procs) -> None:
    """Stop these rank processes (SIGTERM, then SIGKILL after 5 s)."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# ====================================================================================== the ranks
def build_model(m: dict, device):
    """The model of spec ``m`` ({"kind": "mlp", "width", "depth"} or {"kind": "charlm", "d_model",
    "n_layer", "n_head", "context"}) and a function returning its loss on a fixed batch."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    if m["kind"] == "mlp":
        layers = []
        for _ in range(m["depth"]):
            layers += [nn.Linear(m["width"], m["width"]), nn.ReLU()]
        net = nn.Sequential(*layers).to(device)
        x = torch.randn(m["batch"], m["width"], generator=g).to(device)
        return net, lambda model: model(x).square().mean()
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from train import CharGPT  # the trainer's model, scaled up

    net = CharGPT(m["context"], m["d_model"], m["n_layer"], m["n_head"]).to(device)
    idx = torch.randint(0, 256, (m["batch"], m["context"] + 1), generator=g).to(device)
    return net, lambda model: nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def model_name(m: dict, numel: int) -> str:
    if m["kind"] == "mlp":
        return f"mlp {m['width']}x{m['depth']} ({numel / 1e6:.1f}M)"
    return f"charlm d{m['d_model']} L{m['n_layer']} ({numel / 1e6:.1f}M)"


def _register(ddp, mode: str, config_base: dict):
    from fp8_comm_hook import FP8CommConfig, register_grad_comm

    if mode == "fp32":
        return register_grad_comm(ddp, "none")
    if mode == "bf16":
        return register_grad_comm(ddp, "bf16")
    changes = {"fp8": {}, "fp8_ef": {"error_feedback": True}, "auto": {"algorithm": "auto"}}[mode]
    return register_grad_comm(ddp, "fp8", FP8CommConfig(**{**config_base, **changes}))


def _check_shaping(spec, device, rate_gbit):
    """Bus bandwidth (Gbit/s) of a plain fp32 all-reduce: median of 3 after a warm-up, each the
    slowest rank's time. The size moves about a quarter second of traffic at the set rate."""
    import torch
    import torch.distributed as dist

    W = dist.get_world_size()
    nbytes = int(min(max((rate_gbit or 20.0) * 1e9 / 8 * 0.25, 4 << 20), 64 << 20))
    x = torch.zeros(nbytes // 4, device=device)
    dist.all_reduce(x)
    times = []
    for _ in range(3):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    t = statistics.median(times)
    return 2 * (W - 1) / W * nbytes * 8 / t / 1e9 if W > 1 else None


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Tracer:
    """``--trace``: wall-clock spans of one rank's FP8 path (hook entries, every gloo exchange with
    its host copies and, inside it, its pieces on the wire, each bucket's whole two_shot on its
    thread), kept for the step being timed, so that the printed timeline shows where the wire sits
    idle. Patches module attributes of the package in this rank's process only."""

    def __init__(self):
        import threading

        from fp8_comm_hook import collectives, ddp

        self.events, self.t0, self._lock = [], None, threading.Lock()
        orig_x, orig_ts, orig_rb = collectives._exchange_layout_rows, collectives.two_shot, ddp.reduce_bucket
        orig_rows = collectives._exchange_rows

        def span(name, fn, nbytes=0):
            t = time.perf_counter()
            try:
                return fn()
            finally:
                with self._lock:
                    self.events.append((name, threading.current_thread().name, t, time.perf_counter(), nbytes))

        def exchange(layout, out_name, in_name, row_for, group):
            nbytes = getattr(layout, in_name).numel()
            return span(f"exchange {out_name}", lambda: orig_x(layout, out_name, in_name, row_for, group), nbytes)

        def rows(recv, send_row, group):   # the wire part of an exchange, without its host copies
            return span("  pieces", lambda: orig_rows(recv, send_row, group), recv.numel())

        def two_shot(flat, *a, **k):
            return span("two_shot", lambda: orig_ts(flat, *a, **k), flat.numel())

        def reduce_bucket(state, flat, plan, last=True):
            return span("hook", lambda: orig_rb(state, flat, plan, last), flat.numel())

        collectives._exchange_layout_rows, collectives.two_shot, ddp.reduce_bucket = exchange, two_shot, reduce_bucket
        collectives._exchange_rows = rows

    def start(self):
        with self._lock:
            self.events, self.t0 = [], time.perf_counter()

    def report(self, mode: str, step_ms: float) -> str:
        """The kept step's events, in ms from the step's start, and the share of the step in which an
        exchange was running."""
        ev = sorted(self.events, key=lambda e: e[2])
        lines = [f"  trace of {mode} (rank 0, last step, {step_ms:.1f} ms):"]
        busy, end = 0.0, None
        for name, thread, a, b, n in ev:
            lines.append(f"    {1e3 * (a - self.t0):8.2f} - {1e3 * (b - self.t0):8.2f} ms  {thread:14s} {name:22s} {n:>11,d}")
            if name.startswith("exchange"):
                a = max(a, end) if end is not None else a
                if b > a:
                    busy += b - a
                end = max(end or b, b)
        lines.append(f"    exchanges running {1e3 * busy:.1f} ms of the step")
        return "\n".join(lines)


def _time_model(spec, m, device, rank, tracer=None):
    """Every mode's DDP model of spec ``m``, steps interleaved; returns (numel, {mode: [ms per step,
    the slowest rank's]}, auto report). With a :class:`_Tracer`, rank 0 prints the last step of each
    FP8 mode."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    runs = []
    for mode in spec["modes"]:
        net, loss_fn = build_model(m, device)
        ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=spec["bucket_mb"])
        state = _register(ddp, mode, spec["config"])
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
        runs.append((mode, ddp, loss_fn, opt, state, []))
    numel = sum(p.numel() for p in runs[0][1].parameters())
    last = spec["warmup"] + spec["steps"] - 1
    for i in range(spec["warmup"] + spec["steps"]):
        for mode, ddp, loss_fn, opt, state, times in runs:
            dist.barrier()
            _sync(device)
            if tracer is not None:
                tracer.start()
            t0 = time.perf_counter()
            loss_fn(ddp).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            _sync(device)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= spec["warmup"]:
                times.append(float(t) * 1e3)
            if tracer is not None and i == last and rank == 0 and mode.startswith("fp8"):
                print(tracer.report(mode, float(t) * 1e3), flush=True)
    auto = next((dict(st.auto_plan.report(), ddp_native_all_reduce=st.ddp_native_all_reduce)
                 for mode, _, _, _, st, _ in runs if mode == "auto"), None)
    out = {mode: times for mode, _, _, _, _, times in runs}
    del runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return numel, out, auto


def worker(spec_path: str, rank: int) -> None:
    """One rank (run inside its node's namespace by :func:`run_world`)."""
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    tpr = spec["threads_per_rank"]
    if spec["pin"] and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[(rank * tpr + k) % len(cores)] for k in range(tpr)})
    torch.set_num_threads(tpr)
    logging.basicConfig(level=logging.INFO if (rank == 0 and spec["log_auto"]) else logging.WARNING,
                        format="  [rank 0] %(message)s")
    device = torch.device("cuda:0" if spec["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=dist.FileStore(spec["store"], spec["world"]), rank=rank,
                            world_size=spec["world"], timeout=timedelta(seconds=spec["pg_timeout_s"]))
    rate = spec["rate_gbit"]
    busbw = _check_shaping(spec, device, rate)
    if rank == 0:
        set_txt = "unshaped" if rate is None else f"set {rate:g} Gbit/s"
        ratio = f" ({busbw / rate:.2f}x the set rate)" if rate and busbw else ""
        print(f"link {set_txt}: plain fp32 all-reduce bus bandwidth {busbw or float('nan'):.3f} Gbit/s{ratio}",
              flush=True)
    rows = []
    tracer = _Tracer() if spec.get("trace") else None
    for m in spec["models"]:
        numel, times, auto = _time_model(spec, m, device, rank, tracer)
        for mode in spec["modes"]:
            row = dict(nodes=spec["nodes"], ranks_per_node=spec["ranks_per_node"], rate_gbit=rate,
                       measured_busbw_gbit=busbw, model=model_name(m, numel), numel=numel, mode=mode,
                       step_ms=statistics.median(times[mode]), step_ms_all=times[mode], model_spec=m)
            if mode == "auto":
                row["auto"] = auto
            rows.append(row)
            if rank == 0:
                print(f"  {row['model']:28s} {LABELS[mode]:13s} step {row['step_ms']:9.2f} ms", flush=True)
    if rank == 0:
        with open(spec["result"], "w") as f:
            # the device's name comes from a rank: the launcher never opens a CUDA context of its own
            # (an MPS daemon waits for every client before it quits)
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}, f)
    dist.barrier()
    dist.destroy_process_group()


# ====================================================================================== reporting
def _key(r):
    return (r["nodes"], r["ranks_per_node"], r["numel"], r["model"], r["rate_gbit"] is None, r["rate_gbit"] or 0)


def table(rows) -> str:
    """Markdown table: per topology, model and link, each mode's step (ms) with its speed-up over the
    bf16 hook measured in the same run, and auto against the faster of fp32 and the bf16 hook."""
    groups = {}
    for r in rows:
        groups.setdefault(_key(r), {})[r["mode"]] = r
    modes = [m for m in MODES if any(m in g for g in groups.values())]
    head = ["nodes x ranks", "model", "link (Gbit/s)", "measured busbw"] + [f"{LABELS[m]} (ms)" for m in modes]
    head += ["auto vs faster baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(groups):
        g = groups[k]
        any_row = next(iter(g.values()))
        bf16 = g.get("bf16", {}).get("step_ms")
        cells = [f"{k[0]} x {k[1]}", k[3], "unshaped" if any_row["rate_gbit"] is None else f"{any_row['rate_gbit']:g}",
                 f"{any_row['measured_busbw_gbit']:.2f}" if any_row["measured_busbw_gbit"] else "-"]
        for m in modes:
            if m not in g:
                cells.append("-")
                continue
            ms = g[m]["step_ms"]
            cells.append(f"{ms:.1f}" if m == "bf16" or not bf16 else f"{ms:.1f} ({bf16 / ms:.2f}x)")
        base = [g[m]["step_ms"] for m in ("fp32", "bf16") if m in g]
        cells.append(f"{min(base) / g['auto']['step_ms']:.2f}x" if base and "auto" in g else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["nodes"], r["ranks_per_node"], r["model"], r["numel"]) for r in rows},
                    key=lambda p: (p[0], p[1], p[3], p[2]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    rates = sorted({r["rate_gbit"] for r in rows if r["rate_gbit"] is not None})
    x_unshaped = (max(rates) * 4) if rates else 1.0
    for ax, (nodes, rpn, model, numel) in zip(axes[0], panels):
        sub = [r for r in rows if (r["nodes"], r["ranks_per_node"], r["model"], r["numel"]) == (nodes, rpn, model, numel)]
        bf16 = {r["rate_gbit"]: r["step_ms"] for r in sub if r["mode"] == "bf16"}
        for mode in MODES:
            pts = sorted(((r["rate_gbit"] if r["rate_gbit"] is not None else x_unshaped), bf16[r["rate_gbit"]] / r["step_ms"])
                         for r in sub if r["mode"] == mode and r["rate_gbit"] in bf16)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=LABELS[mode], linestyle="--" if mode == "auto" else "-")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xscale("log")
        ticks = rates + ([x_unshaped] if any(r["rate_gbit"] is None for r in sub) else [])
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in rates] + (["unshaped"] if len(ticks) > len(rates) else []))
        ax.minorticks_off()
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel("speed-up over the bf16 hook (step time)")
        ax.set_title(f"{nodes} nodes x {rpn} ranks, {model}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ====================================================================================== main
def _parse_rates(texts):
    out = []
    for t in texts:
        if t.lower() in ("none", "unshaped"):
            out.append(None)
            continue
        try:
            v = float(t)
        except ValueError:
            raise ValueError(f"--rates: {t!r} is not a rate in Gbit/s or 'none'") from None
        if not v > 0:
            raise ValueError(f"--rates: {t!r} must be > 0 Gbit/s (or 'none' for unshaped)")
        out.append(v)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--rates", nargs="+", default=["0.2", "1", "none"], help="link rates in Gbit/s; 'none' = unshaped")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: every rank on cuda:0, sharing the GPU through gloo")
    p.add_argument("--model", default="mlp", choices=["mlp", "charlm"])
    p.add_argument("--width", type=int, default=1024, help="mlp: layer width")
    p.add_argument("--depth", type=int, nargs="+", default=[4], help="mlp: Linear layers (several: one model each)")
    p.add_argument("--d-model", type=int, default=512, help="charlm: model width")
    p.add_argument("--n-layer", type=int, nargs="+", default=[8], help="charlm: blocks (several: one model each)")
    p.add_argument("--n-head", type=int, default=8, help="charlm: attention heads")
    p.add_argument("--context", type=int, default=128, help="charlm: sequence length")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--comm-workers", type=int, default=None,
                   help="FP8_COMM_WORKERS for the ranks: gloo communication threads (default: the environment's, else "
                        "the package's: 2 for CUDA ranks, 1 on CPU)")
    p.add_argument("--trace", action="store_true",
                   help="print rank 0's last step of each FP8 mode: hook entries, exchanges and their threads")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch threads and pinned cores per rank (default: the machine's cores split evenly "
                        "between the ranks, at least 1, as the ranks of a node split its cores)")
    p.add_argument("--no-pin", action="store_true", help="do not pin ranks to cores")
    p.add_argument("--mps", action="store_true",
                   help="with --device cuda: run the ranks as clients of an MPS daemon of their own, so that "
                        "they share the GPU side by side, as ranks on GPUs of their own, not in time slices")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one link rate's world may take")
    p.add_argument("--out", default=None, help="output path without extension (default "
                   "benchmarks/results/network-cpu, or network-<gpu> with --device cuda)")
    p.add_argument("--append", action="store_true",
                   help="merge the rows into an existing <out>.json (rows of the same topology, model, rate and mode replaced)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def run(args) -> dict:
    """Build the cluster, time every rate, tear the cluster down; returns {"rows", metadata}."""
    import torch

    rates = _parse_rates(args.rates)
    if args.nodes < 1 or args.ranks_per_node < 1 or args.steps < 1 or args.warmup < 0:
        raise ValueError("--nodes, --ranks-per-node and --steps must be >= 1, --warmup >= 0")
    if args.threads_per_rank is None:
        args.threads_per_rank = max(1, (os.cpu_count() or 1) // (args.nodes * args.ranks_per_node))
    if args.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be a positive integer, got {args.threads_per_rank}")
    if args.mps and args.device != "cuda":
        raise ValueError("--mps needs --device cuda (it shares one GPU between the CUDA ranks)")
    require_tools()
    mps = MPS().start() if args.mps else None   # before this process touches CUDA
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA GPU; use --device cpu")
        return _run_cluster(args, rates)
    finally:
        if mps is not None:
            mps.stop()


def _run_cluster(args, rates) -> dict:
    """:func:`run` once the checks passed (and the MPS daemon, if any, is up)."""
    import torch

    if args.model == "mlp":
        models = [dict(kind="mlp", width=args.width, depth=d, batch=args.batch) for d in args.depth]
    else:
        models = [dict(kind="charlm", d_model=args.d_model, n_layer=n, n_head=args.n_head, context=args.context,
                       batch=args.batch) for n in args.n_layer]
    base = dict(nodes=args.nodes, ranks_per_node=args.ranks_per_node, device=args.device, models=models,
                modes=args.modes, steps=args.steps, warmup=args.warmup, bucket_mb=args.bucket_mb, config={},
                threads_per_rank=args.threads_per_rank, pin=not args.no_pin, pg_timeout_s=600, log_auto=True,
                trace=args.trace)
    if args.comm_workers is not None:
        if args.comm_workers < 1:
            raise ValueError(f"--comm-workers must be a positive integer, got {args.comm_workers}")
        os.environ["FP8_COMM_WORKERS"] = str(args.comm_workers)  # the ranks inherit it
    cluster = Cluster(args.nodes)
    old = {s: signal.signal(s, _raise_terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    rows, dev = [], "cpu"
    try:
        cluster.up()
        print(f"cluster: {args.nodes} nodes x {args.ranks_per_node} ranks, namespaces {', '.join(cluster.netns)}, "
              f"subnet {cluster.subnet}", flush=True)
        for rate in rates:
            cluster.shape(rate)
            res = run_world(cluster, args.ranks_per_node, dict(base, rate_gbit=rate), timeout_s=args.timeout)
            rows += res["rows"]
            dev = res.get("device", dev)
    finally:
        failed = cluster.down()
        left = cluster.leftovers()
        for s, h in old.items():
            signal.signal(s, h)
        if failed or left:
            print(f"WARNING: could not remove {failed + left}", file=sys.stderr)
        else:
            print(f"removed the cluster ({', '.join(cluster.netns)}, {cluster.bridge})", flush=True)
    meta = dict(device=dev, tensor_device=args.device, backend="gloo", torch=torch.__version__,
                cpu_count=os.cpu_count(), threads_per_rank=args.threads_per_rank,
                comm_workers=_worker_count(torch.device(args.device)), steps=args.steps,
                gpu_sharing=("mps" if args.mps else "time slices") if args.device == "cuda" else None,
                warmup=args.warmup, batch=args.batch, bucket_mb=args.bucket_mb,
                shaping="tc tbf on both ends of each node's veth, burst max(128 KB, 2 ms at the rate)",
                step_ms="median over steps of the slowest rank's forward+backward+SGD step",
                commands=["python scripts/bench_network.py " + " ".join(sys.argv[1:])])
    return {"rows": rows, **meta}


def _worker_count(device) -> int:
    """The communication threads the ranks ran with (``FP8_COMM_WORKERS`` or the package's default
    for ``device``)."""
    from fp8_comm_hook.ddp import _worker_count as count

    return count(device)


def _default_out(device_name: str) -> str:
    """benchmarks/results/network-cpu, or network-<the GPU model, e.g. h200> for CUDA ranks."""
    if device_name == "cpu":
        return "benchmarks/results/network-cpu"
    words = [w for w in device_name.lower().split() if any(c.isdigit() for c in w) and w[0].isalpha()]
    return "benchmarks/results/network-" + (words[0] if words else "cuda")


def main(argv=None):
    """Command line entry point (see the module docstring)."""
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args.worker, args.rank)
    try:
        result = run(args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or _default_out(result["device"])
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    if args.append and os.path.exists(out + ".json"):
        with open(out + ".json") as f:
            old = json.load(f)
        new_keys = {(_key(r), r["mode"]) for r in result["rows"]}
        result["rows"] = [r for r in old["rows"] if (_key(r), r["mode"]) not in new_keys] + result["rows"]
        result["commands"] = old.get("commands", []) + result["commands"]
    result["rows"].sort(key=lambda r: (_key(r), MODES.index(r["mode"])))
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    title = f"DDP step over emulated links (gloo, {result['device']} ranks), speed-up over the bf16 hook"
    plot(result["rows"], out + ".png", title)
    print(table(result["rows"]))
    print(f"wrote {out}.json and {out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
