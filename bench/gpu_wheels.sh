#!/usr/bin/env bash
# Download, on a machine with pip access, the wheels a bare GPU box (Python 3.12, x86-64, its own torch)
# lacks for lorad's GPU tests and benchmarks, into .whl/ (git-ignored). bench/gpu_session.sh installs them.
# The versions are the ones CI tests with; the box's own torch, transformers, peft, accelerate,
# safetensors, rich, pyyaml and nvidia-ml-py are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
WHEELS=(
  bitsandbytes==0.50.2 diffusers==0.42.1
  # pydantic and the pydantic-core it pins, both as in the venv (a mismatch stops every import there)
  "pydantic==$(.venv/bin/python -c 'import pydantic; print(pydantic.VERSION)')"
  "pydantic-core==$(.venv/bin/python -c 'import pydantic_core; print(pydantic_core.__version__)')"
  "starlette==$(.venv/bin/python -c 'import starlette; print(starlette.__version__)')"  # the dashboard tests
  annotated-types typing-inspection
  structlog==26.1.0 watchdog==7.1.0 apscheduler==3.11.3 tzlocal
  pytest-timeout
)
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$w"
done
du -sh .whl
