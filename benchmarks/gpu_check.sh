#!/usr/bin/env bash
# GPU check for one H200 (the device tool; no network there; torch 2.11, transformers 5.17, accelerate, peft, no TRL
# or datasets). First, here: `bash scripts/prepare_gpu_wheels.sh` (TRL + datasets wheels into the ignored .whl/).
# Then one call, under 8 minutes:   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# It prints three tables, at the paper's model shape (Qwen2.5-1.5B config, random weights, bf16):
#   1. proximal log-probs, recompute (no-grad forward) vs loglinear (element-wise)       benchmarks/prox_cost.py
#   2. optimizer steps of the decoupled loss, generation excluded                         benchmarks/step_cost.py
#   3. the real A3POTrainer, in-process generation on the same GPU: sync vs recompute vs loglinear, and
#      asynchronous (max_staleness auto) vs max_staleness=0 (loglinear-noahead)           benchmarks/methods.py
#   4. generated ahead by a colocated vLLM engine (use_vllm=True, vllm_mode="colocate") vs in-process HF generate
#      vs synchronous, same steps; needs vLLM beside the trainer (skipped, saying so, where it cannot be imported:
#      the device has no vLLM and no network; its wheels exceed what `carry` takes)          benchmarks/methods.py
# `bash benchmarks/gpu_check.sh --cpu` runs the same with tiny shapes on a CPU (tests/test_benchmarks.py), table 4 with
# the vLLM venv's Python (A3PO_VLLM_PYTHON, default .venv-vllm/bin/python; scripts/setup.sh --with-vllm).
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
if [ "${1:-}" = "--cpu" ]; then
  python3 benchmarks/prox_cost.py --device cpu --models tiny --shapes 2x16 --prompt-tokens 8 --micro-batch 2 --repeats 2
  python3 benchmarks/step_cost.py --device cpu --model tiny --batch 2 --prompt-tokens 8 --completion-tokens 8 \
      --micro-batch 1 --steps 2
  python3 benchmarks/methods.py --model tiny-shape --methods sync recompute loglinear loglinear-noahead --steps 4 \
      --batch 4 --gradient-accumulation-steps 2 --steps-per-generation 4 --prompt-tokens 8 --completion-tokens 8 \
      --max-staleness 2
  vllm_python=${A3PO_VLLM_PYTHON:-.venv-vllm/bin/python}
  if [ -x "$vllm_python" ] && "$vllm_python" -I -c "import vllm, trl_a3po" 2>/dev/null; then
    VLLM_CPU_KVCACHE_SPACE=1 "$vllm_python" benchmarks/methods.py --model tiny-shape \
        --methods sync loglinear loglinear-colocate --steps 4 --batch 4 --gradient-accumulation-steps 2 \
        --steps-per-generation 4 --prompt-tokens 8 --completion-tokens 8 --max-staleness 2
  else
    echo "4. colocated vLLM: skipped (no vLLM venv with trl_a3po at $vllm_python)"
  fi
  exit 0
fi
timeout 110 python3 benchmarks/prox_cost.py --device cuda --models qwen2.5-1.5b-shape \
    --shapes 16x1024 64x1024 --micro-batch 16 --repeats 5
timeout 110 python3 benchmarks/step_cost.py --device cuda --model qwen2.5-1.5b-shape --batch 64 \
    --prompt-tokens 128 --completion-tokens 1024 --micro-batch 8 --steps 3 --gradient-checkpointing
# 16 samples per optimizer step (8 x 2 accumulated), 4 optimizer steps per generation batch of 64, 3 versions each
timeout 230 python3 benchmarks/methods.py --model qwen2.5-1.5b-shape \
    --methods sync recompute loglinear loglinear-noahead --steps 12 --batch 8 --gradient-accumulation-steps 2 \
    --steps-per-generation 8 --prompt-tokens 128 --completion-tokens 512 --gradient-checkpointing --max-staleness 2
if python3 -c "import vllm" 2>/dev/null; then
  timeout 200 python3 benchmarks/methods.py --model qwen2.5-1.5b-shape --methods sync loglinear loglinear-colocate \
      --steps 12 --batch 8 --gradient-accumulation-steps 2 --steps-per-generation 8 --prompt-tokens 128 \
      --completion-tokens 512 --gradient-checkpointing --max-staleness 2
else
  echo "4. colocated vLLM: skipped (vLLM is not installed on this machine)"
fi
