#!/usr/bin/env bash
# GPU check for one H200 (the device tool; no network there; torch 2.11, transformers 5.17, accelerate, peft, no TRL
# or datasets). First, here: `bash scripts/prepare_gpu_wheels.sh` (TRL + datasets wheels into the ignored .whl/).
# Then one call, about 8 minutes:   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=590)
# The tables, their time boxes and the JSON lines they write: benchmarks/gpu_check.py (its --help).
# `bash benchmarks/gpu_check.sh --cpu` runs every table's code path with tiny shapes on a CPU (tests/test_benchmarks.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -d .whl ] && ! python3 -c "import trl, datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/a3po-site .whl/*.whl
  export PYTHONPATH="/tmp/a3po-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'trl', trl.__version__)"
exec python3 benchmarks/gpu_check.py "$@"
