#!/usr/bin/env bash
# GPU validation in one go: the GPU codec tests, then the codec benchmark.
# Usage: OUT_DIR=/some/dir bash scripts/gpu_validate.sh   (OUT_DIR defaults to $OUT, else benchmarks/results)
# The benchmark runs even when a test fails; the script exits with the tests' status.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-${OUT:-benchmarks/results}}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton unavailable:", e)
PY
start=$(date +%s)
python -m pytest -m gpu -rs -x -q tests/test_gpu_codec.py
test_rc=$?
echo "== tests: rc=$test_rc after $(( $(date +%s) - start )) s"
python scripts/bench_codec.py --out-dir "$OUT_DIR"
bench_rc=$?
echo "== bench: rc=$bench_rc after $(( $(date +%s) - start )) s total; results in $OUT_DIR"
exit $test_rc
