#!/usr/bin/env bash
# One command on a GPU machine: the GPU test suite (every attention backend and the grammar-mask
# kernel against the CPU reference), then bench/one_batch.py once per attention backend.
#
#   bench/gpu_check.sh [RESULTS_DIR]        # default bench/results/gpu
#
# Installs nothing: uses .venv/bin/python if present, else $PYTHON, else python3; flashinfer
# runs only where it is already importable. Every step has a timeout so the whole check ends
# within 5 minutes (about 2-3 on an H200). Exit status: that of the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/gpu}"
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

"$PY" - > "$OUT/env.txt" <<'PYEOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
for name in ("triton", "flashinfer"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:
        print(name, "unavailable:", e)
PYEOF
cat "$OUT/env.txt"
if ! grep -q "available True" "$OUT/env.txt"; then
    echo "gpu_check: no CUDA device here; nothing to check" >&2
    exit 2
fi

echo "== tests/gpu"
timeout 165 "$PY" -m pytest -q -rs -s -p no:cacheprovider tests/gpu --junitxml "$OUT/gpu_tests.xml" \
    > "$OUT/gpu_tests.log" 2>&1
status=$?
grep -E "max\|diff\||max\|logits" "$OUT/gpu_tests.log" > "$OUT/max_abs_diffs.txt"
tail -n 25 "$OUT/gpu_tests.log"

for backend in torch_native triton flashinfer; do
    if [ "$backend" = flashinfer ] && grep -q "^flashinfer unavailable" "$OUT/env.txt"; then
        echo "== one_batch $backend: skipped (flashinfer is not importable)"
        continue
    fi
    echo "== one_batch $backend"
    timeout 45 "$PY" bench/one_batch.py --device cuda --dtype bfloat16 --attention-backend "$backend" \
        --batch-sizes 1 8 32 64 --input-len 512 --output-len 16 --results-dir "$OUT/one_batch_$backend" \
        > "$OUT/one_batch_$backend.log" 2>&1 || echo "one_batch $backend failed (rc $?), see $OUT/one_batch_$backend.log"
    grep -A8 "^prefill" "$OUT/one_batch_$backend.log" || true
done

echo "gpu_check: tests rc=$status; results in $OUT"
exit $status
