#!/usr/bin/env bash
# GPU check for one H200 (the device tool; no network there; torch 2.11 and transformers 5.17 are installed).
# Only torch + transformers are needed: a randomly initialised Qwen2.5-1.5B-shaped model (timings do not depend on
# the weights) and the paper's batch, 64 sequences x (128 prompt + 1,024 completion) tokens. Under 8 minutes; the
# table of each benchmark is printed last.
#   run: command="bash benchmarks/gpu_check.sh", timeout_s=540
set -euo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# Figure 1: proximal log-probs, recompute (no-grad forward) vs loglinear (element-wise)
timeout 200 python3 benchmarks/prox_cost.py --device cuda --models qwen2.5-1.5b-shape \
    --shapes 16x1024 64x1024 --micro-batch 16 --repeats 5
# full optimizer steps (forward/backward of the decoupled loss + AdamW), generation excluded
timeout 240 python3 benchmarks/step_cost.py --device cuda --model qwen2.5-1.5b-shape --batch 64 \
    --prompt-tokens 128 --completion-tokens 1024 --micro-batch 8 --steps 3 --gradient-checkpointing
