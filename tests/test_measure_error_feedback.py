"""scripts/measure_error_feedback.py on digits, world 3, 25 steps (one spawn, ~10 s on 2 CPU cores):
the JSON it writes, and the properties error feedback must show along a fixed trajectory."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "measure_error_feedback.py")
MODES = ["fp8-e4m3", "fp8-e4m3-ef", "fp8-e5m2", "fp8-e5m2-ef"]

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
    for m in MODES:
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
    for fmt, lo, hi in (("e4m3", 0.01, 0.08), ("e5m2", 0.02, 0.16)):
        mean = sum(r[f"fp8-{fmt}"]["step_error"] for r in rows) / len(rows)
        assert lo < mean < hi, (fmt, mean)
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
