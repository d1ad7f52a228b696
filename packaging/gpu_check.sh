#!/usr/bin/env bash
# The GPU check, sized for one lease (under 8 minutes on an H200, nothing fetched).
#
#   make gpu-check-prep      # here, once: build/gpu-check/ = the tokenizer GGUF and the wheels the GPU machine lacks
#   run: packaging/gpu_check.sh     (carry build/gpu-check; PYTHON=... to pick the interpreter)
#
# 1. the Triton kernels compiled (no interpreter) against their torch references: the page store, the packed
#    matmul, the paged decode attention, and the engine's GPU path end to end against its CPU path;
# 2. `kvchat bench speed --device cuda` on random-weight GGUFs of the default model's shape (SmolLM2-135M, Q4_1)
#    and of the 1B and 3B presets (Q4_0): decode / prefill tok/s, weight and KV bytes, the bandwidth achieved
#    beside a device-to-device copy, transformers' generate() on the same weights (default shape and 1B), and the
#    32k-token KV read through the Triton decode attention.
# Results in $OUT (default ./gpu_check_out): env.txt, tests.txt, bench-*.json, summary.txt. Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
PREP=build/gpu-check
mkdir -p "$OUT"
unset TRITON_INTERPRET KVCHAT_GPU_PATH
export PYTHONUNBUFFERED=1 KVCHAT_CACHE_DIR=${KVCHAT_CACHE_DIR:-/tmp/kvchat-gpu-check}
started=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - started) )); }       # seconds of the 8-minute plan still left

"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device visible'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt" \
    || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >> "$OUT/env.txt" 2>&1

# what the GPU machine lacks comes from the carried wheels, into a private folder on PYTHONPATH
SITE=/tmp/kvchat-gpu-site
if [ -d "$PREP/wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links "$PREP/wheels" --target "$SITE" "$PREP"/wheels/*.whl \
        >> "$OUT/env.txt" 2>&1 || echo "some wheels did not install (see env.txt)"
fi
# kvchat itself, not installed there: its one import name points at this checkout (the root is the package)
mkdir -p "$SITE" && ln -sfn "$PWD" "$SITE/kvchat"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
[ -f "$PREP/vocab.gguf" ] && export KVCHAT_VOCAB_GGUF="$PWD/$PREP/vocab.gguf"
"$PY" -c "import gguf, jinja2, psutil, pytest, transformers, tokenizers" >> "$OUT/env.txt" 2>&1 \
    || { echo "a module the check needs is missing: run make gpu-check-prep here and carry build/gpu-check"; exit 1; }

timeout 200 "$PY" -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_triton_matmul.py \
    tests/test_triton_attention.py tests/test_cuda_path.py 2>&1 | tee "$OUT/tests.txt"
tests=${PIPESTATUS[0]}

bench() {   # name, model, transformers yes|no
    local budget; budget=$(left)
    if [ "$budget" -lt 40 ]; then echo "skipped $1: the lease's plan is spent" | tee -a "$OUT/summary.txt"; return; fi
    timeout "$budget" "$PY" -m kvchat.cli.main bench speed --device cuda --model "$2" --transformers "$3" --runs 3 \
        --prompt-tokens 512 --new-tokens 128 --json > "$OUT/bench-$1.json" 2> "$OUT/bench-$1.err"
    echo "bench $1 rc=$?" >> "$OUT/summary.txt"
}
bench default preset:smollm2-135m:Q4_1 yes
bench 1b preset:llama-3.2-1b:Q4_0 yes
bench 3b preset:llama-3.2-3b:Q4_0 no

"$PY" - "$OUT" <<'EOF' >> "$OUT/summary.txt" 2>&1
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/bench-*.json")):
    try:
        r = json.load(open(path))
    except ValueError:
        print(path, "no result"); continue
    k = r["kvchat"]
    line = (f"{r['model']}: decode {k['decode_tok_s']:.1f} tok/s ({r['ratio_decode_vs_bound']:.0%} of the bound "
            f"{r['bound_tok_s']:.0f}, copy {r['copy_gbs']:.0f} GB/s), prefill {k['prefill_tok_s']:.0f} tok/s, "
            f"weights {r['weight_bytes'] / 2**20:.0f} MiB ({r.get('ratio_weights_vs_file', 0):.2f}x the file)")
    if "transformers" in r:
        line += f", {r['ratio_decode_vs_transformers']:.2f}x transformers' decode"
    if "attention" in r:
        line += f", KV read at 32k {r['attention']['gbs']:.0f} GB/s ({r['ratio_attention_vs_copy']:.0%} of copy)"
    if "attention_int8" in r:
        line += f", int8 KV in {r['ratio_attention_int8_vs_bf16_time']:.2f}x bf16's time"
    print(line)
EOF
cat "$OUT/summary.txt"
echo "tests rc=$tests, $(( $(date +%s) - started )) s (outputs in $OUT)"
exit "$tests"
