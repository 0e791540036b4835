"""The emulated-cluster harness of scripts/bench_network.py: it shapes a link (the measured bus
bandwidth within 25% of the set 200 Mbit/s), a 2-rank DDP step runs through it in every mode, and the
namespaces, veths and bridge are gone afterwards, also after a rank failed. Needs root and
ip/tc/nsenter (skipped with the reason otherwise). The only timing assertion is the shaping check."""
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_network as bn  # noqa: E402

RATE_GBIT = 0.2


def _why_not():
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    missing = [t for t in ("ip", "tc", "nsenter") if shutil.which(t) is None]
    return f"needs {', '.join(missing)}" if missing else None


needs_net = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")

SPEC = dict(nodes=2, ranks_per_node=1, device="cpu", modes=list(bn.MODES), steps=1, warmup=1, bucket_mb=25.0,
            models=[dict(kind="mlp", width=128, depth=3, batch=8)], config={"min_compress_numel": 0},
            threads_per_rank=1, pin=True, pg_timeout_s=120, log_auto=False)


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def shaped_run():
    cluster = bn.Cluster(2, tag=f"fnt{os.getpid()}")
    try:
        cluster.up()
        cluster.shape(RATE_GBIT)
        present = [n for n in cluster.netns if n in _namespaces()]
        result = bn.run_world(cluster, 1, dict(SPEC, rate_gbit=RATE_GBIT), timeout_s=300, verbose=False)
    finally:
        failed = cluster.down()
    return dict(result=result, present=present, failed=failed, left=cluster.leftovers(), names=cluster.netns,
                namespaces_after=_namespaces())


@needs_net
def test_link_is_shaped(shaped_run):
    busbw = shaped_run["result"]["rows"][0]["measured_busbw_gbit"]
    assert abs(busbw - RATE_GBIT) <= 0.25 * RATE_GBIT, f"measured {busbw:.3f} Gbit/s at a set {RATE_GBIT} Gbit/s"


@needs_net
def test_every_mode_steps_through_the_link(shaped_run):
    rows = shaped_run["result"]["rows"]
    assert [r["mode"] for r in rows] == list(bn.MODES)
    for r in rows:
        assert r["nodes"] == 2 and r["ranks_per_node"] == 1 and r["rate_gbit"] == RATE_GBIT
        assert r["numel"] == 3 * (128 * 128 + 128) and r["step_ms"] > 0
    auto = next(r for r in rows if r["mode"] == "auto")["auto"]
    # a plan asked for every bucket, or none asked: DDP's own all-reduce left in place
    assert bool(auto["buckets"]) != auto["ddp_native_all_reduce"]
    assert {b["mode"] for b in auto["buckets"]} <= {"two_shot", "none", "bf16"}


@needs_net
def test_cluster_is_gone_afterwards(shaped_run):
    assert shaped_run["present"] == shaped_run["names"]  # it was there while the ranks ran
    assert shaped_run["failed"] == [] and shaped_run["left"] == []
    assert not any(n in shaped_run["namespaces_after"] for n in shaped_run["names"])


@needs_net
def test_failed_rank_stops_the_world_and_cleans_up():
    cluster = bn.Cluster(2, tag=f"fnf{os.getpid()}")
    try:
        cluster.up()
        bad = dict(SPEC, rate_gbit=None, models=[dict(kind="mlp", width=-1, depth=1, batch=2)])
        with pytest.raises(RuntimeError, match="rank . exited"):
            bn.run_world(cluster, 1, bad, timeout_s=120, verbose=False)
    finally:
        assert cluster.down() == []
    assert cluster.leftovers() == []


def test_missing_tools_are_named(monkeypatch):
    monkeypatch.setattr(bn.shutil, "which", lambda tool: None if tool in ("tc", "nsenter") else "/usr/bin/" + tool)
    monkeypatch.setattr(bn.os, "geteuid", lambda: 1000)
    with pytest.raises(bn.SetupError) as e:
        bn.require_tools()
    msg = str(e.value)
    assert "root" in msg and "'tc'" in msg and "'nsenter'" in msg and "'ip'" not in msg


def test_subnet_avoids_networks_in_use():
    import ipaddress

    used = [ipaddress.ip_network("10.231.0.0/16"), ipaddress.ip_network("10.232.0.0/24")]
    net = bn.pick_subnet(used)
    assert net.is_private and net.prefixlen == 24 and not any(net.overlaps(u) for u in used)


def test_rates_parse():
    assert bn._parse_rates(["0.2", "1", "none"]) == [0.2, 1.0, None]
    with pytest.raises(ValueError, match="--rates"):
        bn._parse_rates(["fast"])
    with pytest.raises(ValueError, match="> 0"):
        bn._parse_rates(["0"])


def test_mps_needs_cuda_ranks_and_its_daemon(monkeypatch):
    with pytest.raises(ValueError, match="--mps needs --device cuda"):
        bn.run(bn.build_parser().parse_args(["--mps", "--device", "cpu"]))
    monkeypatch.setattr(bn.shutil, "which", lambda tool: None)
    with pytest.raises(bn.SetupError, match="nvidia-cuda-mps-control"):
        bn.MPS().start()


def test_mps_daemon_env_is_set_for_the_ranks_and_removed_after(monkeypatch, tmp_path):
    """A stand-in control program records how it was called: -d with the pipe and log folders in the
    environment, then 'quit' on stdin; afterwards the folders and the variables are gone."""
    log = tmp_path / "calls"
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text("#!/bin/sh\n"
                   f"echo \"$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)\" >> {log}\n"
                   "mkfifo \"$CUDA_MPS_PIPE_DIRECTORY/control\" 2>/dev/null || true\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    mps = bn.MPS()
    mps.start()
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith(mps.dir) and os.path.isdir(os.environ["CUDA_MPS_LOG_DIRECTORY"])
    folder = mps.dir
    mps.stop()
    mps.stop()  # twice is fine
    calls = log.read_text().splitlines()
    assert calls[0].startswith(f"-d pipe={pipe}") and calls[1] == f" pipe={pipe} stdin=quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not os.path.exists(folder)
