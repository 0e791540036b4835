"""algorithm="auto": the cost model and decision rule with fixed figures (ranks that measured
different figures included), and in gloo worlds of 2, 3 and 4 ranks that every rank gets the same
figures and makes the same choice for every bucket. No timing assertions: the measured figures are
only compared across ranks."""
import copy
import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_checks import batch, digest, exact_mean, local_grads, mlp, rel_err
from dist_harness import run_world, values
from fp8_comm_hook import FP8CommConfig, FP8CommState, register_ddp_hook
from fp8_comm_hook import autotune, collectives
from fp8_comm_hook.autotune import AutoPlan, Figures, break_even_numel, choose, combine, fit_line

# A 1 Gbit/s-like link (8 ns per byte of tensor, 50 us per collective) and a codec of 200 us + 2 ns/element.
SLOW_LINK = Figures(latency_s=50e-6, s_per_byte=8e-9, codec_fixed_s=200e-6, codec_s_per_elem=2e-9)
# Loopback-like: 0.1 ns per byte; the codec's cost per element exceeds what FP8 saves.
FAST_LINK = Figures(latency_s=20e-6, s_per_byte=0.1e-9, codec_fixed_s=200e-6, codec_s_per_elem=2e-9)
BPE = autotune.fp8_bytes_per_elem("block", 128)
# A fast link where FP8 saves 0.57 ps per fp32 element net of the codec: it pays from ~3.9e8 elements.
BEYOND_ANY_BUCKET = Figures(latency_s=20e-6, s_per_byte=1e-12, codec_fixed_s=200e-6, codec_s_per_elem=1.2e-12)


# ---------------------------------------------------------------------------------- pure functions
def test_fit_line():
    assert fit_line(1, 3.0, 3, 7.0) == (1.0, 2.0)
    fixed, slope = fit_line(1000, 5.0, 2000, 4.0)  # noisy, slopes down: all of it fixed
    assert (fixed, slope) == (5.0, 0.0)
    assert fit_line(10, 1.0, 20, 3.0) == (0.0, 0.2)  # would cross below zero: no fixed cost
    with pytest.raises(ValueError, match="x2 > x1"):
        fit_line(2, 1.0, 2, 1.0)


def test_bytes_per_element():
    assert BPE == pytest.approx(1 + 4 / 128)
    assert autotune.fp8_bytes_per_elem("tensor", 128) == 1.0
    assert autotune.fp8_bytes_per_elem("bucket", 16) == 1.0


def test_choice_follows_break_even_on_a_slow_link():
    n0 = break_even_numel(SLOW_LINK, 4, BPE)
    # (latency + codec fixed) / (8 ns * (4 - 1.03125) - 2 * 2 ns) = 250 us / 19.75 ns
    assert autotune.CODEC_WEIGHT == 2.0
    assert n0 == int(250e-6 / (8e-9 * (4 - BPE) - 2 * 2e-9)) + 1
    assert choose(SLOW_LINK, n0 - 1, 4, BPE) == "none"
    assert choose(SLOW_LINK, n0, 4, BPE) == "two_shot"
    assert choose(SLOW_LINK, 25_000_000 // 4, 4, BPE) == "two_shot"
    # bf16 buckets save fewer bytes per element: FP8 pays only for larger buckets
    n0_bf16 = break_even_numel(SLOW_LINK, 2, BPE)
    assert n0_bf16 > n0
    assert choose(SLOW_LINK, n0_bf16 - 1, 2, BPE) == "none" and choose(SLOW_LINK, n0_bf16, 2, BPE) == "two_shot"


def test_fast_link_never_compresses():
    assert break_even_numel(FAST_LINK, 4, BPE) is None
    for n in (1, 10_000, 10_000_000, 10 ** 9):
        assert choose(FAST_LINK, n, 4, BPE) == "none"


# A LAN-like link where the bf16 casts (0.5 ns/element) cost less than the 2 bytes they save, and
# the codec (4 ns/element) more than FP8's 3 bytes.
LAN_LINK = Figures(latency_s=20e-6, s_per_byte=1e-9, codec_fixed_s=200e-6, codec_s_per_elem=4e-9, cast_s_per_elem=0.5e-9)


def test_bf16_is_chosen_where_it_is_predicted_fastest():
    n = 4_000_000
    assert autotune.predict_cast_s(LAN_LINK, n) == pytest.approx(20e-6 + 1e-9 * 2 * n + 0.5e-9 * n)
    assert choose(LAN_LINK, n, 4, BPE, cast=True) == "bf16"
    assert choose(LAN_LINK, n, 4, BPE, cast=False) == "none"        # the group cannot sum bf16
    assert choose(LAN_LINK, n, 2, BPE, cast=True) == "none"         # a bf16 bucket has nothing to cast
    costly_casts = Figures(20e-6, 1e-9, 200e-6, 4e-9, cast_s_per_elem=3e-9)
    assert choose(costly_casts, n, 4, BPE, cast=True) == "none"
    slow = Figures(**{**SLOW_LINK.__dict__, "cast_s_per_elem": 0.5e-9})
    assert choose(slow, n, 4, BPE, cast=True) == "two_shot"         # 8 ns/byte: FP8's 3 bytes win
    assert choose(slow, 1000, 4, BPE, cast=True) == "bf16"          # too small for the codec's fixed cost
    # a backend that sums bf16 slowly (measured per element): the plain all-reduce wins again
    slow_bf16 = Figures(**{**LAN_LINK.__dict__, "bf16_s_per_elem": 3.8e-9})
    assert autotune.predict_cast_s(slow_bf16, n) == pytest.approx(20e-6 + 3.8e-9 * n + 0.5e-9 * n)
    assert choose(slow_bf16, n, 4, BPE, cast=True) == "none"
    plan = AutoPlan(LAN_LINK, 2, BPE, cast=True)
    assert plan(n, 4) == "bf16" and plan(n, 2) == "none"
    rep = plan.report()
    assert rep["bf16_allowed"] and {b["mode"] for b in rep["buckets"]} == {"bf16", "none"}
    assert [b["predicted_bf16_ms"] is None for b in rep["buckets"]] == [True, False]  # sorted: (n, 2), (n, 4)


def _fake_measurements(monkeypatch, times, slowest=lambda s: s, codec_per_elem=1e-9, asked=None):
    """measure_local's timers replaced: all-reduce times from ``times[(numel, dtype)]`` (each
    ``(numel, dtype)`` asked for appended to ``asked`` where given), the codec 100 us +
    ``codec_per_elem`` s/element, the casts 0.1 ns/element; ``slowest`` stands for the MAX over ranks."""
    def time_all_reduce(n, group, device, repeats, dtype=torch.float32):
        if asked is not None:
            asked.append((n, dtype))
        return times[(n, dtype)]

    monkeypatch.setattr(collectives, "time_all_reduce", time_all_reduce)
    monkeypatch.setattr(collectives, "bf16_all_reduce_works", lambda group, device: True)
    monkeypatch.setattr(autotune, "slowest_rank_s", lambda s, group, device: slowest(s))
    monkeypatch.setattr(autotune, "time_codec", lambda codec, cfg, n, W, r, dev, rep: 1e-4 + codec_per_elem * n)
    monkeypatch.setattr(autotune, "time_cast", lambda n, W, dev, rep: 1e-10 * n)


def test_larger_all_reduce_grows_until_it_measures_the_sustained_rate(monkeypatch):
    """The larger timed all-reduce grows x4 from 1M elements while the slowest rank took under
    SUSTAINED_S, up to MAX_ALL_REDUCE: short transfers ride on the link's burst and the socket
    buffers (the unshaped-veth case: 4 MB looked twice as fast per byte as a bucket, and
    12.6M-element buckets went plain where bf16 was faster). bf16 is timed at the same final size.
    Every rank decides on the slowest rank's time, so all run the same all-reduces."""
    from types import SimpleNamespace
    M = 1 << 20
    assert autotune.MAX_ALL_REDUCE == 16 * M and autotune.SUSTAINED_S == 0.05
    f32, b16 = torch.float32, torch.bfloat16
    times = {(4096, f32): 0.3e-3, (M, f32): 2.3e-3, (4 * M, f32): 16.3e-3, (16 * M, f32): 64.3e-3,
             (4096, b16): 0.3e-3, (M, b16): 3.0e-3, (4 * M, b16): 9.0e-3, (16 * M, b16): 36.0e-3}
    asked = []
    state = SimpleNamespace(group=None, config=FP8CommConfig(), world_size=2, rank=0, codec_for=lambda d: None)
    _fake_measurements(monkeypatch, times, codec_per_elem=9e-9, asked=asked)   # the torch codec on one CPU core
    f = autotune.measure_local(state, torch.device("cpu"))
    assert [n for n, d in asked if d == f32] == [4096, M, 4 * M, 16 * M]
    assert [n for n, d in asked if d == b16] == [4096, 16 * M]
    assert f.s_per_byte == pytest.approx((64.3e-3 - 0.3e-3) / (4 * (16 * M - 4096)))
    assert f.latency_s == pytest.approx(0.3e-3 - f.s_per_byte * 4 * 4096)
    assert f.bf16_s_per_elem == pytest.approx((36.0e-3 - 0.3e-3) / (16 * M - 4096))
    # the 12.6M-element fp32 bucket of that run: bf16 now, plain with the 4 MB figure
    assert choose(f, 12_595_200, 4, BPE, cast=True) == "bf16"
    four_mb = Figures(*autotune.fit_line(4 * 4096, 0.3e-3, 4 * M, 2.3e-3), f.codec_fixed_s, f.codec_s_per_elem,
                      f.cast_s_per_elem, autotune.fit_line(4096, 0.3e-3, M, 3.0e-3)[1])
    assert choose(four_mb, 12_595_200, 4, BPE, cast=True) == "none"

    # the growth stops at the first size that took SUSTAINED_S on the slowest rank (here another
    # rank's 4M took 50 ms): every rank fits on 4M
    asked.clear()
    _fake_measurements(monkeypatch, times, slowest=lambda s: s if s < 10e-3 else max(s, 0.05), codec_per_elem=9e-9,
                       asked=asked)
    f = autotune.measure_local(state, torch.device("cpu"))
    assert [n for n, d in asked if d == f32] == [4096, M, 4 * M]
    assert f.s_per_byte == pytest.approx((16.3e-3 - 0.3e-3) / (4 * (4 * M - 4096)))
    assert f.bf16_s_per_elem == pytest.approx((9.0e-3 - 0.3e-3) / (4 * M - 4096))

    # a slow link: the 1M all-reduce already took SUSTAINED_S, nothing larger is timed
    asked.clear()
    _fake_measurements(monkeypatch, times, slowest=lambda s: max(s, autotune.SUSTAINED_S), codec_per_elem=9e-9,
                       asked=asked)
    f = autotune.measure_local(state, torch.device("cpu"))
    assert [n for n, d in asked if d == f32] == [4096, M]
    assert f.s_per_byte == pytest.approx((2.3e-3 - 0.3e-3) / (4 * (M - 4096)))
    assert f.bf16_s_per_elem == pytest.approx((3.0e-3 - 0.3e-3) / (M - 4096))

    # a link too fast to reach SUSTAINED_S below the cap: the cap's time is used
    asked.clear()
    fast = {k: v / 100 for k, v in times.items()}
    _fake_measurements(monkeypatch, fast, codec_per_elem=9e-9, asked=asked)
    f = autotune.measure_local(state, torch.device("cpu"))
    assert [n for n, d in asked if d == f32] == [4096, M, 4 * M, 16 * M]
    assert f.s_per_byte == pytest.approx((64.3e-5 - 0.3e-5) / (4 * (16 * M - 4096)))


def test_noisy_all_reduce_timings_never_make_the_link_free(monkeypatch):
    """When the larger timed all-reduce comes out no slower than the smaller (noise on a shared
    host), the figures take the larger one's time as all bandwidth instead of a zero cost per byte
    (which made every bucket go plain on the H200 at 25 Gbit/s: 0.66x the bf16 hook)."""
    from types import SimpleNamespace
    times = {(4096, torch.float32): 5.2e-3, (1 << 20, torch.float32): 5.1e-3,
             (4096, torch.bfloat16): 3.0e-3, (1 << 20, torch.bfloat16): 2.9e-3}
    # another rank's 1M all-reduce took SUSTAINED_S: nothing larger is timed
    _fake_measurements(monkeypatch, times, slowest=lambda s: autotune.SUSTAINED_S)
    state = SimpleNamespace(group=None, config=FP8CommConfig(), world_size=2, rank=0, codec_for=lambda d: None)
    f = autotune.measure_local(state, torch.device("cpu"))
    assert f.latency_s == 0.0 and f.s_per_byte == pytest.approx(5.1e-3 / (4 << 20))
    assert f.bf16_s_per_elem == pytest.approx(2.9e-3 / (1 << 20))
    assert f.codec_fixed_s == pytest.approx(1e-4) and f.codec_s_per_elem == pytest.approx(1e-9)
    assert f.cast_s_per_elem == pytest.approx(1e-10)
    # a priced link: a compressing mode wins (bf16: 2.77 + 0.1 ns/element against FP8's
    # 1.22 * 1.03 + 2 * 1 and the plain all-reduce's 4.9)
    assert choose(f, 4_000_000, 4, BPE, cast=True) == "bf16"
    assert choose(f, 4_000_000, 4, BPE, cast=False) == "two_shot"


def test_bf16_choice_becomes_plain_where_it_cannot_apply():
    """A plan answering "bf16" for a bucket of bf16 gradients or a reduce-scatter gets the plain
    collective (the bf16 recipe is an all-reduce of a wider dtype)."""
    from fp8_comm_hook.layout import LayoutSpec
    st = FP8CommState(FP8CommConfig(algorithm="auto", min_compress_numel=0))
    st._world = (2, 0, "gloo")
    st.set_auto_plan(lambda n, e: "bf16")
    assert st.prepare(torch.zeros(4096, dtype=torch.bfloat16), LayoutSpec.single("a", 4096)).mode == "none"
    assert st.prepare(torch.zeros(4096), LayoutSpec.shards("b", 4096, 2, 0), "reduce_scatter").mode == "none"
    assert st.prepare(torch.zeros(4096), LayoutSpec.single("c", 4096)).mode == "bf16"
    s = st.stats()
    assert s["uncompressed_buckets"] == 2 and s["bf16_buckets"] == 1 and s["compressed_buckets"] == 0


def test_predictions_are_the_documented_formulas():
    f, n = SLOW_LINK, 1_000_000
    assert autotune.predict_plain_s(f, n, 4) == pytest.approx(50e-6 + 8e-9 * 4e6)
    assert autotune.predict_two_shot_s(f, n, BPE) == pytest.approx(2 * 50e-6 + 8e-9 * n * BPE + 200e-6 + 2 * 2e-9 * n)
    assert autotune.predict_cast_s(f, n) == pytest.approx(50e-6 + 2 * 8e-9 * n)   # no casts measured


# Figures measured by two CPU ranks (one core each) over 1 Gbit/s and 0.2 Gbit/s links, 12.6M-element
# MLP: there the FP8 step took 335 ms against the bf16 hook's 287 at 1 Gbit/s, and 782 against 1134
# at 0.2 Gbit/s (the codec, 7.3 ns/element alone, shares the core with the backward pass).
CPU_1GBIT = Figures(latency_s=2.43e-3, s_per_byte=8.14e-9, codec_fixed_s=0.51e-3, codec_s_per_elem=7.34e-9,
                    cast_s_per_elem=0.86e-9, bf16_s_per_elem=16.6e-9)
CPU_UNSHAPED = Figures(latency_s=0.33e-3, s_per_byte=1 / 0.931e9, codec_fixed_s=0.72e-3, codec_s_per_elem=6.95e-9,
                       cast_s_per_elem=0.95e-9, bf16_s_per_elem=2.53e-9)
CPU_200MBIT = Figures(latency_s=0.0, s_per_byte=41.5e-9, codec_fixed_s=0.76e-3, codec_s_per_elem=8.81e-9,
                      cast_s_per_elem=0.94e-9, bf16_s_per_elem=82.0e-9)


@pytest.mark.parametrize("numel", [5_248_000, 7_347_200, 12_595_200])
def test_codec_counts_twice_against_the_wire(numel):
    """Counted once, the codec's 7.3 ns/element made FP8 look 7% faster than bf16 at 1 Gbit/s, where
    the FP8 step was 17% slower; counted twice (it delays the backward too), bf16 wins there and FP8
    still wins at 0.2 Gbit/s. Unshaped, the casts counted once choose bf16 (the bf16 hook 7% faster
    than DDP's fp32 all-reduce there)."""
    once = (2 * CPU_1GBIT.latency_s + CPU_1GBIT.s_per_byte * numel * BPE + CPU_1GBIT.codec_fixed_s
            + CPU_1GBIT.codec_s_per_elem * numel)
    assert once < autotune.predict_cast_s(CPU_1GBIT, numel)
    assert choose(CPU_1GBIT, numel, 4, BPE, cast=True) == "bf16"
    assert choose(CPU_200MBIT, numel, 4, BPE, cast=True) == "two_shot"
    assert choose(CPU_UNSHAPED, numel, 4, BPE, cast=True) == "bf16"


def test_ranks_with_different_figures_decide_alike_after_combining():
    """Two ranks that measured on either side of the break-even point: alone they would choose
    differently for the same bucket (a hang); the combined (MAX) figures give one choice, the same
    whichever order the ranks' figures come in."""
    rank0 = Figures(latency_s=40e-6, s_per_byte=8e-9, codec_fixed_s=150e-6, codec_s_per_elem=1e-9)
    rank1 = Figures(latency_s=60e-6, s_per_byte=0.5e-9, codec_fixed_s=400e-6, codec_s_per_elem=3e-9)
    n = 200_000
    assert choose(rank0, n, 4, BPE) != choose(rank1, n, 4, BPE)
    both = combine([rank0, rank1])
    assert both == Figures(60e-6, 8e-9, 400e-6, 3e-9)
    assert combine([rank1, rank0]) == both
    plans = [AutoPlan(combine(order), 2, BPE) for order in ([rank0, rank1], [rank1, rank0])]
    for size in (1000, 30_000, n, 5_000_000):
        assert plans[0](size, 4) == plans[1](size, 4) == choose(both, size, 4, BPE)
    with pytest.raises(ValueError):
        combine([])


def test_plan_logs_each_bucket_size_once_and_reports(caplog):
    plan = AutoPlan(SLOW_LINK, 4, BPE)
    with caplog.at_level(logging.INFO, logger="fp8_comm_hook"):
        for _ in range(3):
            assert plan(10, 4) == "none"
            assert plan(4_000_000, 4) == "two_shot"
    lines = [r.getMessage() for r in caplog.records if "auto: bucket" in r.getMessage()]
    assert len(lines) == 2, lines
    rep = plan.report()
    assert rep["figures"]["s_per_byte"] == 8e-9 and rep["world_size"] == 4
    assert [(b["numel"], b["mode"]) for b in rep["buckets"]] == [(10, "none"), (4_000_000, "two_shot")]
    assert rep["break_even_numel"]["fp32"] == break_even_numel(SLOW_LINK, 4, BPE)


def test_warmup_and_min_compress_numel_keep_their_meaning():
    st = FP8CommState(FP8CommConfig(algorithm="auto", warmup_steps=2, min_compress_numel=1000))
    st.set_auto_plan(AutoPlan(SLOW_LINK, 2, BPE))
    big = 10_000_000
    assert st.mode_for(big) == "none"          # warm-up
    st.step = 2
    assert st.mode_for(999) == "none"          # below min_compress_numel, whatever the plan says
    assert st.mode_for(big) == "two_shot"
    assert st.mode_for(1000) == "none"         # the plan: too small to pay
    st.set_auto_plan(AutoPlan(FAST_LINK, 2, BPE))
    assert st.mode_for(big) == "none"
    assert st.auto_plan.report()["figures"]["s_per_byte"] == FAST_LINK.s_per_byte


def test_auto_without_a_plan_is_two_shot_and_says_so(caplog):
    st = FP8CommState(FP8CommConfig(algorithm="auto", min_compress_numel=0))
    with caplog.at_level(logging.WARNING, logger="fp8_comm_hook"):
        assert st.mode_for(100) == "two_shot"
        assert st.mode_for(100) == "two_shot"
    assert sum("without a measured plan" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------------------------- gloo worlds
def _auto_ddp(model, **ddp_kw):
    """An auto-registered DDP model whose hook is registered whatever the plan (these checks force
    plans or count buckets; :func:`chk_native_all_reduce_where_nothing_gains` covers the other case)."""
    import os
    os.environ["FP8_COMM_AUTO_NATIVE"] = "0"
    try:
        d = DDP(model, **ddp_kw)
        return d, register_ddp_hook(d, FP8CommConfig(algorithm="auto", min_compress_numel=0))
    finally:
        del os.environ["FP8_COMM_AUTO_NATIVE"]


def chk_native_all_reduce_where_nothing_gains(rank, W):
    """Figures where no bucket size gains from FP8 or bf16 (a loopback-like link): register_ddp_hook
    leaves DDP's own all-reduce in place, no hook (the gradients are bit-identical to a DDP model
    without one, the state counts nothing); with FP8_COMM_AUTO_NATIVE=0 the hook is registered and
    sends every bucket plain (the same mean within fp32 rounding, every bucket counted)."""
    import os
    fast = Figures(latency_s=20e-6, s_per_byte=0.1e-9, codec_fixed_s=200e-6, codec_s_per_elem=2e-9,
                   cast_s_per_elem=0.5e-9, bf16_s_per_elem=0.3e-9)
    real = autotune.measure
    autotune.measure = lambda state, device, **kw: fast
    try:
        ref_model = mlp(depth=4, width=128)
        plain = DDP(copy.deepcopy(ref_model), bucket_cap_mb=0.1)
        native = DDP(copy.deepcopy(ref_model), bucket_cap_mb=0.1)
        st = register_ddp_hook(native, FP8CommConfig(algorithm="auto", min_compress_numel=0))
        # FP8 would pay only from ~3.9e8 elements, far beyond any bucket of this model: native too
        autotune.measure = lambda state, device, **kw: BEYOND_ANY_BUCKET
        beyond = register_ddp_hook(DDP(copy.deepcopy(ref_model), bucket_cap_mb=0.1),
                                   FP8CommConfig(algorithm="auto", min_compress_numel=0))
        autotune.measure = lambda state, device, **kw: fast
        os.environ["FP8_COMM_AUTO_NATIVE"] = "0"
        try:
            hooked = DDP(copy.deepcopy(ref_model), bucket_cap_mb=0.1)
            st_hooked = register_ddp_hook(hooked, FP8CommConfig(algorithm="auto", min_compress_numel=0))
        finally:
            del os.environ["FP8_COMM_AUTO_NATIVE"]
    finally:
        autotune.measure = real
    errs = []
    for it in range(3):
        for m in (plain, native, hooked):
            local_grads(m, *batch(rank, it))
        errs += [rel_err(a.grad, b.grad) for a, b in zip(hooked.parameters(), plain.parameters())]
    try:
        register_ddp_hook(native, FP8CommConfig(algorithm="auto"))
        again = "registered twice"
    except RuntimeError as e:
        again = str(e)
    return dict(native=st.ddp_native_all_reduce, hooked=st_hooked.ddp_native_all_reduce,
                beyond=beyond.ddp_native_all_reduce,
                beyond_break_even=beyond.auto_plan.report()["break_even_numel"]["fp32"],
                workers=(st.worker is None, st_hooked.worker is not None),
                same_bits=all(torch.equal(a.grad, b.grad) for a, b in zip(native.parameters(), plain.parameters())),
                native_stats=st.stats(), hooked_stats=st_hooked.stats(), max_err=max(errs), again=again)


def chk_registration_measures_same_plan(rank, W):
    """register_ddp_hook measures; every rank holds the same figures and makes the same choice for
    every bucket; the averaged gradients are bit-identical across ranks."""
    model = mlp(depth=8, width=256)
    d, st = _auto_ddp(model, bucket_cap_mb=0.1)
    for it in range(3):
        local_grads(d, *batch(rank, it))
    rep = st.auto_plan.report()
    return dict(figures=rep["figures"], buckets=[(b["numel"], b["mode"]) for b in rep["buckets"]],
                stats=st.stats(), digest=digest([p.grad for p in d.parameters()]))


def _forced_plan_run(rank, large_mode):
    """Three steps of an auto-registered DDP model whose plan sends buckets of >= 20,000 elements
    with ``large_mode`` and the rest plain; returns the largest relative error of a gradient
    against the exact mean, the stats and a digest of the gradients."""
    ref_model = mlp(depth=8, width=256)
    d, st = _auto_ddp(copy.deepcopy(ref_model), bucket_cap_mb=0.1)
    st.set_auto_plan(lambda n, e: large_mode if n >= 20_000 else "none")
    errs = []
    for it in range(3):
        x, y = batch(rank, it)
        ref = local_grads(ref_model, x, y)
        local_grads(d, x, y)
        for name, p in d.module.named_parameters():
            errs.append(rel_err(p.grad, exact_mean(ref[name])))
    return dict(max_err=max(errs), stats=st.stats(), digest=digest([p.grad for p in d.parameters()]))


def chk_forced_mixed_plan(rank, W):
    """A plan that sends the large buckets FP8 and the small ones plain: both paths in one step,
    the mean right (FP8 error bound on the whole model), every rank bit-identical."""
    return _forced_plan_run(rank, "two_shot")


def chk_forced_bf16_plan(rank, W):
    """A plan that sends the large buckets with the bf16 recipe, the small ones plain: the mean within
    bf16's error, every rank bit-identical, the bf16 buckets counted with half the bytes."""
    return dict(_forced_plan_run(rank, "bf16"), bf16_sums=collectives.bf16_all_reduce_works(None, torch.device("cpu")))


def chk_bf16_wire_is_kept_and_exact(rank, W):
    """auto's bf16 buckets cast into a bf16 buffer kept in the bucket's plan (the same buffer every
    step); cast_all_reduce into a given buffer gives the bits of the recipe with a new tensor (two
    calls on different data), and refuses a buffer of the wrong dtype or shape."""
    gen = torch.Generator().manual_seed(100 + rank)
    wire = torch.empty(5000, dtype=torch.bfloat16)
    same = []
    for _ in range(2):
        x = torch.randn(5000, generator=gen) * 10 ** rank
        a, b = x.clone(), x.clone()
        collectives.cast_all_reduce(a)
        collectives.cast_all_reduce(b, wire=wire)
        same.append(torch.equal(a, b))
    refused = []
    for bad in (torch.empty(5000, dtype=torch.float16), torch.empty(4999, dtype=torch.bfloat16)):
        try:
            collectives.cast_all_reduce(torch.zeros(5000), wire=bad)
            refused.append(False)
        except ValueError:
            refused.append(True)
    d, st = _auto_ddp(mlp(depth=8, width=256), bucket_cap_mb=0.1)
    st.set_auto_plan(lambda n, e: "bf16" if n >= 20_000 else "none")
    ptrs = []
    for it in range(3):
        local_grads(d, *batch(rank, it))
        wires = [p.memo.get("bf16_wire") for p, _, _ in st._plans.values() if p.mode == "bf16"]
        ptrs.append(sorted(w.data_ptr() for w in wires if w is not None) if all(w is not None for w in wires) else None)
    return dict(same=same, refused=refused, ptrs=ptrs, bf16_buckets=st.stats()["bf16_buckets"])


def chk_measure_combines_different_figures(rank, W):
    """Each rank 'measures' different figures (rank-dependent, injected): measure() hands every rank
    the element-wise maximum."""
    st = FP8CommState(FP8CommConfig(algorithm="auto"))
    real = autotune.measure_local
    try:
        autotune.measure_local = lambda state, device, **kw: Figures(1e-6 * (rank + 1), 1e-9 * (W - rank), 1e-4,
                                                                     1e-9 * (1 + rank % 2))
        f = autotune.measure(st, torch.device("cpu"))
    finally:
        autotune.measure_local = real
    return f


def chk_tune_on_request(rank, W):
    """tune() again on a state (e.g. after the network changed): a new plan, the same on every rank."""
    st = FP8CommState(FP8CommConfig(algorithm="auto"))
    plan = autotune.tune(st, torch.device("cpu"), all_reduce_sizes=(256, 65536), codec_sizes=(4096, 65536))
    return dict(same=st.auto_plan is plan, modes=[plan(n, e) for n in (1000, 10 ** 6, 10 ** 8) for e in (2, 4)],
                figures=plan.figures)


class _MixedDtypeNet(torch.nn.Module):
    """Three fp32 layers (the largest weight 65,536 elements) and one bf16 layer."""

    def __init__(self):
        super().__init__()
        self.fp32 = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Linear(512, 128), torch.nn.Linear(128, 128))
        self.bf16 = torch.nn.Linear(128, 128).to(torch.bfloat16)

    def forward(self, x):
        return self.bf16(self.fp32(x).to(torch.bfloat16)).float()


def chk_largest_bucket_bound(rank, W):
    """ddp.largest_bucket_numel bounds the buckets DDP really forms (cap 0.1 MB, parameters of 128
    to 65,536 elements, two larger than the cap; fp32 and bf16 ones), recorded by a hook in the
    steps after the first (after it DDP rebuilds its buckets)."""
    from fp8_comm_hook.ddp import largest_bucket_numel
    d = DDP(_MixedDtypeNet(), bucket_cap_mb=0.1)
    seen = {}

    def hook(step, bucket):
        e = bucket.buffer().element_size()
        if step[0] > 0:   # the first iteration may run every gradient as one bucket (not bounded)
            seen[e] = max(seen.get(e, 0), bucket.buffer().numel())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    step = [0]
    d.register_comm_hook(step, hook)
    g = torch.Generator().manual_seed(rank)
    for step[0] in range(3):
        d(torch.randn(8, 128, generator=g)).square().mean().backward()
    return dict(bound=largest_bucket_numel(d), seen=seen)


CHECKS = [chk_largest_bucket_bound, chk_registration_measures_same_plan, chk_native_all_reduce_where_nothing_gains, chk_forced_mixed_plan, chk_forced_bf16_plan,
          chk_bf16_wire_is_kept_and_exact, chk_measure_combines_different_figures, chk_tune_on_request]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world(request):
    return request.param, run_world(request.param, CHECKS)


def test_registration_plan_agrees_across_ranks(world):
    W, res = world
    v = values(res, "chk_registration_measures_same_plan")
    assert all(x["figures"] == v[0]["figures"] for x in v)
    assert all(x["buckets"] == v[0]["buckets"] for x in v) and len(v[0]["buckets"]) >= 2
    assert len({x["digest"] for x in v}) == 1
    assert all(x["stats"]["steps"] == 3 for x in v)
    f = v[0]["figures"]
    assert all(f[k] >= 0 for k in f) and f["latency_s"] + f["s_per_byte"] > 0


def test_auto_leaves_ddp_native_where_nothing_gains(world):
    W, res = world
    for x in values(res, "chk_native_all_reduce_where_nothing_gains"):
        assert x["native"] is True and x["hooked"] is False
        assert x["beyond"] is True and x["beyond_break_even"] > 10 ** 8   # a break-even, but no bucket reaches it
        assert x["workers"] == (True, True)   # gloo: the hooked state keeps its worker, the native one none
        assert x["same_bits"]
        assert x["native_stats"]["steps"] == 0 and x["native_stats"]["bytes_sent"] == 0
        s = x["hooked_stats"]
        assert s["steps"] == 3 and s["uncompressed_buckets"] > 0 and s["compressed_buckets"] == s["bf16_buckets"] == 0
        assert x["max_err"] < 1e-6
        assert "already registered" in x["again"]


def test_largest_bucket_bound_holds(world):
    W, res = world
    for x in values(res, "chk_largest_bucket_bound"):
        assert set(x["bound"]) == set(x["seen"]) == {2, 4}
        assert all(x["seen"][e] <= x["bound"][e] for e in x["seen"])
        # cap // 4 + the largest fp32 parameter (65,536), below the 148,224 fp32 elements in all; bf16: all
        assert x["bound"] == {4: 26_214 + 65_536, 2: 16_512}


def test_always_plain():
    assert AutoPlan(FAST_LINK, 2, BPE).always_plain([2, 4])
    assert not AutoPlan(SLOW_LINK, 2, BPE).always_plain([4])
    assert not AutoPlan(SLOW_LINK, 2, BPE).always_plain([2, 4])
    # bf16's 2 + 0.5 ns/element beat the plain 4 ns for fp32 gradients; bf16 gradients have no cast
    assert not AutoPlan(LAN_LINK, 2, BPE, cast=True).always_plain([4])
    assert AutoPlan(LAN_LINK, 2, BPE, cast=False).always_plain([4])
    assert AutoPlan(LAN_LINK, 2, BPE, cast=True).always_plain([2])
    # a link where FP8 never pays for fp32 gradients but does for fp64 ones (7 bytes saved per element)
    f = Figures(latency_s=20e-6, s_per_byte=1e-9, codec_fixed_s=200e-6, codec_s_per_elem=1.5e-9)
    assert AutoPlan(f, 2, BPE).always_plain([2, 4]) and not AutoPlan(f, 2, BPE).always_plain([4, 8])


def test_always_plain_below_the_largest_bucket():
    """FP8 that would pay only for buckets larger than the model can form leaves every bucket plain."""
    f = BEYOND_ANY_BUCKET
    n0 = break_even_numel(f, 4, BPE)
    assert n0 == int(220e-6 / (1e-12 * (4 - BPE) - 2 * 1.2e-12)) + 1
    plan = AutoPlan(f, 2, BPE)
    assert not plan.always_plain([4])                               # no bound: some bucket could gain
    assert plan.always_plain([4], {4: 6_553_600})                   # 25 MB buckets never reach n0
    assert plan.always_plain([4], {4: n0 - 1})
    assert not plan.always_plain([4], {4: n0})
    assert not plan.always_plain([2, 4], {2: 10, 4: n0})            # any element size that can gain decides
    assert plan.always_plain([2, 4], {4: 1000})                     # bf16: no break-even at all
    assert not plan.always_plain([4], {4: None})


def test_forced_mixed_plan_runs_both_paths(world):
    W, res = world
    v = values(res, "chk_forced_mixed_plan")
    for x in v:
        assert x["stats"]["compressed_buckets"] > 0 and x["stats"]["uncompressed_buckets"] > 0
        assert x["max_err"] < 0.045
    assert len({x["digest"] for x in v}) == 1


def test_forced_bf16_plan(world):
    W, res = world
    v = values(res, "chk_forced_bf16_plan")
    assert all(x["bf16_sums"] for x in v), "gloo cannot sum bf16 here"
    for x in v:
        s = x["stats"]
        assert s["bf16_buckets"] > 0 and s["uncompressed_buckets"] > 0 and s["compressed_buckets"] == 0, s
        assert s["bytes_sent"] < 0.75 * s["bytes_baseline"], s
        assert 0 < x["max_err"] < 0.02, x["max_err"]
    assert len({x["digest"] for x in v}) == 1


def test_bf16_wire_is_kept_and_exact(world):
    W, res = world
    for x in values(res, "chk_bf16_wire_is_kept_and_exact"):
        assert x["same"] == [True, True] and x["refused"] == [True, True]
        assert x["bf16_buckets"] > 0
        # DDP rebuilds its buckets after the first step; from then on each bucket keeps its buffer
        assert x["ptrs"][1] and x["ptrs"][1] == x["ptrs"][2], x["ptrs"]


def test_measure_gives_every_rank_the_maximum(world):
    W, res = world
    v = values(res, "chk_measure_combines_different_figures")
    expected = combine([Figures(1e-6 * (r + 1), 1e-9 * (W - r), 1e-4, 1e-9 * (1 + r % 2)) for r in range(W)])
    for f in v:
        assert f.as_list() == pytest.approx(expected.as_list(), rel=1e-12)
    assert len({tuple(f.as_list()) for f in v}) == 1


def test_tune_on_request_agrees(world):
    W, res = world
    v = values(res, "chk_tune_on_request")
    assert all(x["same"] for x in v)
    assert v[0]["figures"].bf16_s_per_elem >= 0   # gloo sums bf16: its all-reduce was timed
    assert all(x["modes"] == v[0]["modes"] and x["figures"] == v[0]["figures"] for x in v)


def test_prepare_bucket_reuses_the_plan_and_counts_every_bucket():
    """A DDP bucket seen before gets the same plan object (one lookup), every call is counted in the
    stats, and the plan changes with the mode (warm-up over) and after bind() or a layout retired."""
    st = FP8CommState(FP8CommConfig(warmup_steps=1, min_compress_numel=0))
    st._world = (2, 0, "gloo")
    flat = torch.zeros(3000)
    params = [torch.zeros(1000), torch.zeros(2000)]
    grads = [flat[:1000], flat[1000:]]
    p0 = st.prepare_bucket(params, grads, flat)
    assert p0.mode == "none" and st.prepare_bucket(params, grads, flat) is p0
    st.end_bucket(True)
    p1 = st.prepare_bucket(params, grads, flat)
    assert p1.mode == "two_shot" and p1.memo is not None and st.prepare_bucket(params, grads, flat) is p1
    s = st.stats()
    assert s["uncompressed_buckets"] == 2 and s["compressed_buckets"] == 2
    assert s["bytes_baseline"] == 4 * 2 * 3000 * 4 // 2   # 4 buckets of a ring all-reduce at W = 2
    st.bind(torch.nn.Linear(2, 2))
    p2 = st.prepare_bucket(params, grads, flat)
    assert p2 is not p1 and p2.layout is p1.layout   # same spec contents: the layout is kept
    other = torch.zeros(3000)                        # the bucket's buffer moved (DDP rebuilt its buckets)
    p3 = st.prepare_bucket(params, [other[:1000], other[1000:]], other)
    assert p3 is not p2 and st.prepare_bucket(params, grads, other) is p3


def test_prepare_bucket_finds_a_live_buffer_without_asking_for_its_parameters():
    """A bucket buffer's tensor object seen before finds its plan without calling ``params`` (the
    hook passes ``bucket.parameters`` uncalled); another object over the same memory, a mode change
    or forgotten plans go through the parameters again, and a dead buffer's entry never matches."""
    st = FP8CommState(FP8CommConfig(warmup_steps=1, min_compress_numel=0))
    st._world = (2, 0, "gloo")
    flat = torch.zeros(3000)
    params = [torch.zeros(1000), torch.zeros(2000)]
    grads = [flat[:1000], flat[1000:]]
    asked = []

    def bucket_parameters():
        asked.append(1)
        return params

    p0 = st.prepare_bucket(bucket_parameters, grads, flat)
    assert len(asked) == 1 and p0.mode == "none"
    assert st.prepare_bucket(bucket_parameters, grads, flat) is p0 and len(asked) == 1
    st.end_bucket(True)                               # warm-up over: a new mode, asked again
    p1 = st.prepare_bucket(bucket_parameters, grads, flat)
    assert p1.mode == "two_shot" and len(asked) == 2
    for _ in range(3):
        assert st.prepare_bucket(bucket_parameters, grads, flat) is p1
    assert len(asked) == 2
    alias = flat.view(-1)                             # same memory, another object: the slow path, same plan
    assert st.prepare_bucket(bucket_parameters, grads, alias) is p1 and len(asked) == 3
    assert st.stats()["compressed_buckets"] == 5
    st.bind(torch.nn.Linear(2, 2))                    # plans forgotten: asked again
    p2 = st.prepare_bucket(bucket_parameters, grads, flat)
    assert p2 is not p1 and len(asked) == 4
    # A dead buffer's entry: its weak reference is dead, so an object reusing its id cannot match
    # (the reuse is forced here by filing the dead entry under the new object's id).
    dead = torch.zeros(3000)
    st.prepare_bucket(params, [dead[:1000], dead[1000:]], dead)
    entry = st._buffer_plans[id(dead)]
    del dead
    assert entry[0]() is None
    reuser = torch.zeros(3000)
    st._buffer_plans[id(reuser)] = entry
    p3 = st.prepare_bucket(bucket_parameters, [reuser[:1000], reuser[1000:]], reuser)
    assert len(asked) == 5 and p3.mode == "two_shot"   # the slow path (parameters asked for), not the entry


def test_a_rebuilt_bucket_drops_the_old_buffers_plan():
    """When DDP rebuilds its buckets (new buffers holding the same parameters) or a bucket's mode
    moves on, the superseded plans go, and with them whatever they kept alive: a CUDA-graph runner in
    a plan's memo holds its bucket buffer, which must not stay pinned for the rest of training."""
    import gc
    import weakref

    st = FP8CommState(FP8CommConfig(warmup_steps=1, min_compress_numel=0))
    st._world = (2, 0, "gloo")
    params = [torch.zeros(1000), torch.zeros(2000), torch.zeros(500)]

    def bucket(ps):
        flat = torch.zeros(sum(p.numel() for p in ps))
        grads, o = [], 0
        for p in ps:
            grads.append(flat[o:o + p.numel()])
            o += p.numel()
        return flat, grads

    old_flat, old_grads = bucket(params[:2])
    p0 = st.prepare_bucket(params[:2], old_grads, old_flat)
    p0.memo["graph_run"] = lambda: old_flat           # what a graph runner holds on CUDA
    other_flat, other_grads = bucket(params[2:])
    p_other = st.prepare_bucket(params[2:], other_grads, other_flat)
    # DDP rebuilds: a new buffer holds the same two parameters; the old buffer is dropped by DDP.
    new_flat, new_grads = bucket(params[:2])
    p1 = st.prepare_bucket(params[:2], new_grads, new_flat)
    assert p1 is not p0 and len(st._plans) == 2
    gone = weakref.ref(old_flat)
    del old_flat, old_grads, p0
    gc.collect()
    assert gone() is None, "the superseded plan still holds the old bucket buffer"
    assert st.prepare_bucket(params[2:], other_grads, other_flat) is p_other   # other buckets keep theirs
    st.end_bucket(True)                                # warm-up over: the "none" plans are superseded
    p2 = st.prepare_bucket(params[:2], new_grads, new_flat)
    assert p2.mode == "two_shot" and len(st._plans) == 2
    assert st.prepare_bucket(params[:2], new_grads, new_flat) is p2
    assert len(st._buffer_plans) == 2                # new_flat -> p2, other_flat -> p_other
    assert sum(e[2] is p1 for e in st._buffer_plans.values()) == 0
