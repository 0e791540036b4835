#!/usr/bin/env bash
# Every GPU test of the suite in one go (core at world 1 over NCCL, FSDP through gloo with CUDA
# tensors, the GPU codecs), logged to $OUT_DIR/gpu-tests.log; exits with pytest's status.
#   OUT_DIR=/some/dir bash scripts/gpu_session.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-${OUT:-benchmarks/results}}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT_DIR/gpu-tests.log"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" 2>&1 | tee -a "$OUT_DIR/gpu-tests.log"
python -c "import transformer_engine.pytorch, transformer_engine_torch as t; print('transformer_engine ok')" 2>&1 | tail -1 | tee -a "$OUT_DIR/gpu-tests.log"
python -m pytest -m gpu -rs -q -p no:cacheprovider --timeout 300 \
    tests/test_gpu_core.py tests/test_gpu_fsdp.py tests/test_gpu_codec.py 2>&1 | tee -a "$OUT_DIR/gpu-tests.log"
