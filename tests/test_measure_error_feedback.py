"""studies/measure_error_feedback.py on digits, world 3, 25 steps (one spawn, ~10 s on 2 CPU cores):
the JSON it writes, and the properties error feedback must show along a fixed trajectory."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "studies", "measure_error_feedback.py")
FP8_MODES = ["fp8-e4m3", "fp8-e4m3-ef", "fp8-e5m2", "fp8-e5m2-ef"]
MODES = ["bf16", *FP8_MODES]

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("ef") / "ef.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--task", "digits", "--steps", "25", "--world", "3",
                           "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "drift/no-EF" in proc.stdout
    assert os.path.getsize(os.path.splitext(out)[0] + ".png") > 1000
    return json.loads(out.read_text())


def test_schema(result):
    assert result["task"] == "digits" and result["world"] == 3 and result["steps"] == 25
    assert result["modes"] == MODES and len(result["rows"]) == 25
    assert [r["step"] for r in result["rows"]] == list(range(1, 26))
    assert sorted(result["config"]) == sorted(FP8_MODES)  # bf16 is the trainer's recipe, not an FP8 config
    for m in FP8_MODES:
        assert result["config"][m]["fp8_format"] == m.split("-")[1]
        assert result["config"][m]["error_feedback"] is m.endswith("-ef")
        assert result["config"][m]["min_compress_numel"] == 0


def test_first_step_has_no_residual_yet(result):
    first = result["rows"][0]
    for m in MODES:
        # one step: the accumulated error is that step's error
        assert first[m]["drift"] == pytest.approx(first[m]["step_error"], rel=1e-9)
    assert first["fp8-e4m3-ef"] == first["fp8-e4m3"]
    assert first["fp8-e5m2-ef"] == first["fp8-e5m2"]


def test_per_step_error_matches_the_formats(result):
    rows = result["rows"]
    for mode, lo, hi in (("bf16", 5e-4, 8e-3), ("fp8-e4m3", 0.01, 0.08), ("fp8-e5m2", 0.02, 0.16)):
        mean = sum(r[mode]["step_error"] for r in rows) / len(rows)
        assert lo < mean < hi, (mode, mean)
    # one mantissa bit fewer: about twice the error
    e4 = sum(r["fp8-e4m3"]["step_error"] for r in rows)
    e5 = sum(r["fp8-e5m2"]["step_error"] for r in rows)
    assert 1.5 < e5 / e4 < 2.7


def test_error_feedback_bounds_the_accumulated_error(result):
    last = result["rows"][-1]
    for fmt in ("e4m3", "e5m2"):
        plain, ef = last[f"fp8-{fmt}"]["drift"], last[f"fp8-{fmt}-ef"]["drift"]
        assert ef < 0.5 * plain, (fmt, ef, plain)
        assert result["summary"][f"fp8-{fmt}-ef"]["final_drift_vs_without_ef"] == pytest.approx(ef / plain)


def test_adam_view_is_recorded(result):
    rows, last = result["rows"], result["rows"][-1]
    for m in MODES:
        # one step: the displacement is lr times that step's update, so its drift is the update error
        assert rows[0][m]["displacement_drift"] == pytest.approx(rows[0][m]["update_error"], rel=1e-9)
        for r in rows:
            assert r[m]["update_error"] > 0 and math.isfinite(r[m]["displacement_drift"])
        # FP8 rounding keeps Adam's direction: the mode's update has ~the exact update's length along it
        along = result["summary"][m]["mean_update_along"]
        assert 0.9 < along < 1.05, (m, along)
        assert result["summary"][m]["mean_update_along"] == pytest.approx(
            sum(r[m]["update_along"] for r in rows) / len(rows))
    for fmt in ("e4m3", "e5m2"):
        s = result["summary"][f"fp8-{fmt}-ef"]
        assert s["final_displacement_drift_vs_without_ef"] == pytest.approx(
            last[f"fp8-{fmt}-ef"]["displacement_drift"] / last[f"fp8-{fmt}"]["displacement_drift"])
        # error feedback bounds the summed gradients far better than what Adam makes of them
        assert s["final_displacement_drift_vs_without_ef"] > s["final_drift_vs_without_ef"]


def _script_module():
    sys.path.insert(0, REPO)
    try:
        from studies import measure_error_feedback
    finally:
        sys.path.pop(0)
    return measure_error_feedback


@pytest.mark.parametrize("betas,eps", [((0.9, 0.999), 1e-8), ((0.8, 0.95), 1e-6)])
def test_shadow_adam_moves_like_torch_adam(betas, eps):
    shadow_cls = _script_module().ShadowAdam
    gen = torch.Generator().manual_seed(3)
    n = 4096
    param = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([param], lr=1.0, betas=betas, eps=eps)
    shadow = shadow_cls(n, betas, eps)
    for step in range(40):
        g = torch.randn(n, generator=gen, dtype=torch.float64)
        if step % 2:  # heavy tails (a Gaussian over a uniform: Cauchy-like) and a few outliers
            g = g / torch.rand(n, generator=gen, dtype=torch.float64).clamp_min(1e-3) * 1e-3
            g[:5] = 1e3
        before = param.detach().clone()
        param.grad = g.clone()
        opt.step()
        u = shadow.update(g)
        torch.testing.assert_close(before - param.detach(), u, rtol=1e-10, atol=1e-12)
    assert shadow.t == 40


def test_clipped_scales_like_clip_grad_norm():
    mod = _script_module()
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(1000, generator=gen, dtype=torch.float64) * 0.1
    for max_norm in (0.5, 1.0, 100.0):
        ref = torch.nn.Parameter(g.clone())
        ref.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([ref], max_norm)
        torch.testing.assert_close(mod.clipped(g, max_norm), ref.grad, rtol=1e-12, atol=0)
    assert mod.clipped(g, 0) is g
