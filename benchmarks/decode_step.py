"""Where a compiled decoding step's time goes: the compiled forward alone vs the whole step (logits processors,
sampling, the behaviour log-prob, stopping criteria, HF's loop), at two batch sizes. A diagnostic for the decoder.

    python benchmarks/decode_step.py --model qwen2.5-1.5b-shape --batches 64 128 --completion-tokens 256
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import GenerationConfig


sys.path.insert(0, str(Path(__file__).resolve().parent))
from prox_cost import SHAPES, build, sync  # noqa: E402
from report import emit  # noqa: E402

from trl_a3po.rollout import InProcessBackend  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    model = build(args.model, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    forward_s = []
    get_compiled_call = model.get_compiled_call

    def timed_compiled_call(compile_config):
        call = get_compiled_call(compile_config)

        def timed(*a, **k):
            sync(args.device)
            start = time.perf_counter()
            out = call(*a, **k)
            sync(args.device)
            forward_s.append(time.perf_counter() - start)
            return out

        return timed

    model.get_compiled_call = timed_compiled_call
    config = GenerationConfig(
        max_new_tokens=args.completion_tokens, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=1
    )
    backend = InProcessBackend(model, config, 0, [1], compiled=True)
    for batch in args.batches:
        prompts = [[5 + i % 100] * args.prompt_tokens for i in range(batch)]
        backend.generate(prompts, threading.Event())  # compile / capture for this shape
        forward_s.clear()
        sync(args.device)
        start = time.perf_counter()
        ids, _ = backend.generate(prompts, threading.Event())
        sync(args.device)
        wall = time.perf_counter() - start
        steps = len(forward_s)
        row = dict(
            batch=batch,
            tokens_per_s=sum(map(len, ids)) / wall,
            step_ms=1000 * wall / max(steps, 1),
            forward_ms=1000 * sorted(forward_s)[len(forward_s) // 2] if forward_s else float("nan"),
            compiled_steps=steps,
        )
        print(row, flush=True)
        emit(args.jsonl, "decode_step", model=args.model, **row)


if __name__ == "__main__":
    main()
