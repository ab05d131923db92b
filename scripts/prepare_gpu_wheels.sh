#!/usr/bin/env bash
# Wheels for the lent GPU machine (benchmarks/gpu_check.sh): it has torch, transformers, accelerate, peft, pyarrow,
# pandas, xxhash and fsspec, but no TRL or datasets and no network. Downloads the missing pure-Python wheels (for its
# Python 3.12, no dependencies resolved: the list is exactly what it lacks) into .whl/ (git-ignored), which the device
# tool carries: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"]). About 1.3 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -la .whl
