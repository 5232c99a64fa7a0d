#!/usr/bin/env bash
# The one GPU check (docs/bench.md): tests/workers/test_gpu.py, then `python -m tools.bench gpu`,
# their logs and the benchmark's JSON under OUTDIR; the last lines printed are the summary.
# Needs nothing from the network: torch and Triton are on the GPU machine, the rest travels as
# wheels in .whl/ (tools/gpu_wheels.sh, here; carry ".whl"). Budget: under 8 minutes.
#   tools/gpu_check.sh OUTDIR                                  (on the GPU machine)
#   JUSTAPI_TEST_GPU_DEVICE=cpu tools/gpu_check.sh OUTDIR      (a dry run on a CPU)
# Time limits: GPU_CHECK_TESTS_S (210) and GPU_CHECK_BENCH_S (240) seconds; a CPU dry run
# defaults to 600 each (the interpreter on a shared CPU is slow, and its times mean nothing).
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
DRY_S=$([ "${JUSTAPI_TEST_GPU_DEVICE:-cuda}" = cpu ] && echo 600 || echo "")
TESTS_S=${GPU_CHECK_TESTS_S:-${DRY_S:-210}}
BENCH_S=${GPU_CHECK_BENCH_S:-${DRY_S:-240}}
{
  date -u +"start %FT%TZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"
timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --durations=8 \
  tests/workers/test_gpu.py 2>&1 | tee "$OUT/tests.log"
TESTS=${PIPESTATUS[0]}
timeout "$BENCH_S" "$PY" -m tools.bench gpu --profile --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
BENCH=${PIPESTATUS[0]}
echo "tests exit $TESTS ($(tail -1 "$OUT/tests.log"); limit $TESTS_S s), bench exit $BENCH (limit $BENCH_S s)"
[ "$TESTS" = 0 ] && [ "$BENCH" = 0 ]
