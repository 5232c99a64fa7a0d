#!/usr/bin/env bash
# The one GPU check (docs/bench.md): the GPU tests, then the offline benchmark (`python -m
# tools.bench gpu --weights auto`) and the served one (`python -m tools.bench gpu-serve`: justapi
# serve --gpu + justapi bench serve) on SmolLM2 (the GGUF where installed, else its shape and
# types, random) and a ~1B llama built here as a Q4_K_M GGUF (random blocks of llama.cpp's mix),
# and last every GPU target of issue 38 with its figure (`python -m tools.bench gpu-targets`).
# Logs and JSON land in OUTDIR. Needs nothing from the network: torch and Triton are on the GPU
# machine, the rest travels as wheels in .whl/ (tools/gpu_wheels.sh, here; carry ".whl").
# Budget: under 8 minutes (the model files are written while the tests run).
#   tools/gpu_check.sh OUTDIR                                  (on the GPU machine)
#   JUSTAPI_TEST_GPU_DEVICE=cpu tools/gpu_check.sh OUTDIR      (a dry run on a CPU)
# Time limits in seconds: GPU_CHECK_TESTS_S (200), GPU_CHECK_BENCH_S (120), GPU_CHECK_SERVE_S
# (140); a CPU dry run defaults to 900 each (the interpreter on a shared CPU is slow, and its
# times mean nothing), runs two of the test files and the benchmarks on one-layer models.
set -uo pipefail
OUT=${1:?usage: tools/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import zmq, orjson, gguf, fastapi, uvicorn" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/justapi-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/justapi-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JUSTAPI_CACHE_DIR=${JUSTAPI_CACHE_DIR:-/tmp/justapi-synthetic}
IS_DRY=$([ "${JUSTAPI_TEST_GPU_DEVICE:-cuda}" = cpu ] && echo 1 || echo "")
TESTS_S=${GPU_CHECK_TESTS_S:-${IS_DRY:+900}}; TESTS_S=${TESTS_S:-200}
BENCH_S=${GPU_CHECK_BENCH_S:-${IS_DRY:+900}}; BENCH_S=${BENCH_S:-120}
SERVE_S=${GPU_CHECK_SERVE_S:-${IS_DRY:+900}}; SERVE_S=${SERVE_S:-140}
MODELS=$("$PY" -c "from tools.bench.gpu import LLAMA_1B_Q4_K_M as L, DRY_RUN_Q4_K_M as D
print(D if '$IS_DRY' else 'smollm2;' + L)")
# a dry run's workers take the GPU's weight path too: the device kernels in Triton's interpreter
[ -n "$IS_DRY" ] && BENCH_ENV=(env JUSTAPI_DEVICE_BLOCKS=1 TRITON_INTERPRET=1) || BENCH_ENV=(env)
TESTS=(tests/workers/test_gpu.py tests/workers/test_device_blocks.py)
[ -z "$IS_DRY" ] && TESTS+=(tests/workers/test_moe_grouped.py tests/workers/test_triton_shapes.py
  tests/workers/test_triton_attention.py tests/workers/test_triton_layer_ops.py
  tests/workers/test_step_graphs.py tests/workers/test_device_upload.py)
{
  date -u +"start %FT%TZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"
# the benchmarks' GGUF files (SmolLM2's stand-in where its package is missing, the 1B Q4_K_M),
# written on the CPU while the tests run on the GPU
"$PY" -c "
from tools.bench.gpu_run import resolve
for model in '$MODELS'.split(';'):
    print(*resolve(model), flush=True)" >"$OUT/models.log" 2>&1 &
BUILD=$!
timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --durations=8 "${TESTS[@]}" \
  2>&1 | tee "$OUT/tests.log"
TESTS_RC=${PIPESTATUS[0]}
wait "$BUILD"; cat "$OUT/models.log"
timeout "$BENCH_S" "${BENCH_ENV[@]}" "$PY" -m tools.bench gpu --weights auto --models "$MODELS" --modes graphs,eager \
  --batches "$([ -n "$IS_DRY" ] && echo 1 || echo 1,16,64)" --rounds 1 \
  --decode-steps "$([ -n "$IS_DRY" ] && echo 2 || echo 24)" \
  --mixed-chunk "$([ -n "$IS_DRY" ] && echo 24 || echo 256)" --profile --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}
timeout "$SERVE_S" "${BENCH_ENV[@]}" "$PY" -m tools.bench gpu-serve --models "$MODELS" --json "$OUT/serve.json" \
  2>&1 | tee "$OUT/serve.log"
SERVE_RC=${PIPESTATUS[0]}
"$PY" -m tools.bench gpu-targets "$OUT/bench.json" "$OUT/serve.json" 2>&1 | tee "$OUT/targets.log"
echo "tests exit $TESTS_RC ($(tail -1 "$OUT/tests.log"); limit $TESTS_S s), bench exit $BENCH_RC" \
  "(limit $BENCH_S s), serve exit $SERVE_RC (limit $SERVE_S s)"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$SERVE_RC" = 0 ]
