#!/usr/bin/env bash
# Every GPU test of the suite in one go, then optionally the codec benchmark.
#
#   bash scripts/gpu_check.sh                       # versions + every test marked gpu
#   bash scripts/gpu_check.sh --bench [ARGS...]     # ... then scripts/bench_codec.py ARGS
#   OUT_DIR=/some/dir bash scripts/gpu_check.sh     # where the log (and benchmark) go
#
# Prints the versions (torch, CUDA, triton, NCCL, Transformer Engine when importable, nvidia-smi),
# then runs `pytest -m gpu` over the whole of tests/ (the core at world 1 over NCCL, FSDP through
# gloo with CUDA tensors, the GPU codecs, and any GPU test added later), all logged to
# $OUT_DIR/gpu-tests.log. OUT_DIR defaults to $OUT, else benchmarks/results. With --bench the codec
# benchmark runs afterwards even when a test failed (its JSON and PNG go to $OUT_DIR, its output to
# $OUT_DIR/bench-codec.log). Exits with the tests' status. Without a GPU every test skips with the
# reason printed.
set -u -o pipefail
cd "$(dirname "$0")/.."

bench=0
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bench) bench=1; shift; bench_args=("$@"); break ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

OUT_DIR="${OUT_DIR:-${OUT:-benchmarks/results}}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu-tests.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

{
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    python - <<'PY' 2>&1
import sys

import torch

cuda = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if cuda else None)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton unavailable:", repr(e))
try:
    print("nccl", torch.cuda.nccl.version() if cuda else None)
except Exception as e:
    print("nccl unavailable:", repr(e))
try:
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401
    print("transformer_engine", getattr(transformer_engine, "__version__", "(version unknown)"))
except Exception as e:
    print("transformer_engine unavailable:", repr(e))
PY
} | tee "$LOG"

python -m pytest -m gpu -rs -q -p no:cacheprovider --timeout 300 tests 2>&1 | tee -a "$LOG"
test_rc=${PIPESTATUS[0]}
echo "== tests: rc=$test_rc after $(( $(date +%s) - start )) s; log in $LOG" | tee -a "$LOG"

if [ "$bench" = 1 ]; then
    python scripts/bench_codec.py --out-dir "$OUT_DIR" "${bench_args[@]}" 2>&1 | tee "$OUT_DIR/bench-codec.log"
    bench_rc=${PIPESTATUS[0]}
    echo "== bench: rc=$bench_rc after $(( $(date +%s) - start )) s total; results in $OUT_DIR"
fi
exit "$test_rc"
