#!/usr/bin/env bash
# Kernel checks on a CUDA machine: the compiled Triton kernels (no interpreter) against their torch
# references, then `bench kernels`. Needs a python with CUDA torch, triton and pytest (PYTHON=...);
# no .venv. Results go to $OUT (default ./gpu_check_out). Exit status: non-zero if either failed.
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

# Loaded by path so the engine package (transformers etc.) need not import on the GPU box.
"$PY" -c "import importlib.util as u, sys; s = u.spec_from_file_location('bench_kernels', 'bench/kernels.py'); \
m = u.module_from_spec(s); s.loader.exec_module(m); m.main(sys.argv[1:])" --json "$@" \
    > "$OUT/bench_kernels.json" 2> "$OUT/bench_kernels.err"
bench=$?
cat "$OUT/bench_kernels.err"
echo "tests rc=$tests  bench rc=$bench  (outputs in $OUT)"
exit $(( tests != 0 || bench != 0 ))
