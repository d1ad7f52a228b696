#!/usr/bin/env bash
# Kernel checks on a CUDA machine: the compiled Triton page store (no interpreter) against its torch
# reference (tests/test_kernels.py). The CUDA decode attention backend and its benchmark come with
# the GPU issue (27). Needs a python with CUDA torch, triton and pytest (PYTHON=...); no .venv.
# Results go to $OUT (default ./gpu_check_out). Exit status: non-zero if the tests failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device visible'; \
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt" || exit 1

"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py --junitxml="$OUT/test_kernels.xml" 2>&1 | tee "$OUT/test_kernels.txt"
tests=${PIPESTATUS[0]}
echo "tests rc=$tests  (outputs in $OUT)"
exit "$tests"
