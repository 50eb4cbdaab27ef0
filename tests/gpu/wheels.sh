#!/usr/bin/env bash
# Download into .whl/ the wheels tests/gpu/run.sh installs on a GPU machine without network access:
# the runtime dependencies a CUDA PyTorch image usually lacks (jsonschema and its own dependencies, pyzmq and
# msgpack for --kv-events, cryptography for signatures, llguidance for structured output).
# Run on a machine with network access, from the repository root; PYVER is the GPU machine's Python.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${PYVER:-3.12}
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  jsonschema==4.26.0 referencing==0.37.0 jsonschema-specifications==2025.9.1 rpds-py==0.30.0 \
  pyzmq==27.3.0 msgpack==1.2.4 cryptography==48.0.0 cffi==2.0.0 pycparser==3.0 llguidance==1.9.1
