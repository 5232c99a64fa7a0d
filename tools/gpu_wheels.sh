#!/usr/bin/env bash
# Fetch, here (with network), the wheels the GPU machine lacks into .whl/ (git-ignored), for
# tools/gpu_check.sh to install there with no network. That machine's image has python3.12,
# torch and Triton, click, httpx, jinja2, numpy, tokenizers, uvloop, prometheus-client,
# nvidia-ml-py, pytest and hypothesis; our other runtime needs travel as these wheels (~8 MB).
#   tools/gpu_wheels.sh            then carry ".whl" with the device run
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pyzmq==27.3.0 orjson==3.13.0 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 anyio==4.16.0 annotated-doc==0.0.7 uvicorn==0.54.0
        opentelemetry-api==1.45.2 llguidance==1.9.1 httptools==0.9.0)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
du -sh .whl
