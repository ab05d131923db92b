"""The in-process decoders side by side: HF generate as TRL configures it (dynamic cache, eager) vs the compiled one
(static cache, `generate`'s own torch.compile + CUDA graphs: `generation_compile`), through the producer's real
`InProcessBackend`, on one random model built on the device.

    python benchmarks/decoders.py --model qwen2.5-1.5b-shape --batch 64 --prompt-tokens 128 --completion-tokens 512
    python benchmarks/decoders.py --model tiny --device cpu --batch 4 --completion-tokens 16    # CPU smoke run

Per decoder: the first call's seconds (compilation and graph capture included), generated tokens/s over the calls after
it, a version loaded in place before the last call (a new version must not recompile), the recompilations counted by
torch._dynamo over the whole row, and the peak GPU memory. A random model almost never samples EOS, so every row
decodes all `--completion-tokens`.
"""

from __future__ import annotations

import argparse
import statistics
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


DECODERS = {"hf-generate": False, "compiled": True}


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(name: str, model, prompts, config, args) -> dict:
    backend = InProcessBackend(model, config, pad_token_id=0, eos_token_ids=[1], compiled=DECODERS[name])
    stop = threading.Event()
    graphs_before = unique_graphs()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    calls = []
    for call in range(args.calls):
        if call == args.calls - 1:  # a new version, loaded in place as the producer loads one
            with torch.no_grad():
                staged = backend.stage({k: v * 1.001 for k, v in model.state_dict().items()})
            backend.load(staged)
        sync(args.device)
        start = time.perf_counter()
        ids, logprobs = backend.generate(prompts, stop)
        sync(args.device)
        calls.append((time.perf_counter() - start, sum(map(len, ids))))
        assert all(len(row) == len(lp) for row, lp in zip(ids, logprobs))
        assert all(x == x and x <= 0 for row in logprobs for x in row)  # finite log-probs (no NaN), <= 0
    steady = calls[1:]
    return {
        "decoder": name,
        "compiled_in_use": backend.compiled,
        "first_call_s": calls[0][0],
        "steady_call_s": statistics.median(s for s, _ in steady),
        "tokens_per_s": sum(n for _, n in steady) / sum(s for s, _ in steady),
        "first_tokens_per_s": calls[0][1] / calls[0][0],
        "recompilations": unique_graphs() - graphs_before,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--decoders", nargs="+", default=list(DECODERS), choices=list(DECODERS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3, help="calls per decoder (>= 2: the first one warms up)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--jsonl", default=None, help="also append each row to this JSON-lines file")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.model, args.device, dtype)
    g = torch.Generator().manual_seed(0)
    # ragged prompts (up to --prompt-tokens), token ids past the pad (0) and EOS (1)
    prompts = [
        torch.randint(
            2, model.config.vocab_size, (args.prompt_tokens - int(torch.randint(0, 8, (1,), generator=g)),)
        ).tolist()
        for _ in range(args.batch)
    ]
    config = GenerationConfig(
        max_new_tokens=args.completion_tokens, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=1
    )
    print(
        f"model={args.model} device={args.device} dtype={dtype} batch={args.batch} "
        f"prompt<={args.prompt_tokens} completion={args.completion_tokens} calls={args.calls}"
    )
    header = f"{'decoder':<13}{'tok/s':>10}{'first call s':>14}{'call s':>9}{'recompiles':>12}{'peak GB':>9}"
    print(header)
    print("-" * len(header))
    rows = {}
    for name in args.decoders:
        row = measure(name, model, prompts, config, args)
        rows[name] = row
        print(
            f"{name:<13}{row['tokens_per_s']:>10.0f}{row['first_call_s']:>14.1f}{row['steady_call_s']:>9.2f}"
            f"{row['recompilations']:>12}{row['peak_memory_gb']:>9.1f}"
            + ("" if row["compiled_in_use"] == DECODERS[name] else "  (fell back to HF generate)")
        )
        emit(
            args.jsonl,
            "decoders",
            model=args.model,
            batch=args.batch,
            prompt_tokens=args.prompt_tokens,
            completion_tokens=args.completion_tokens,
            **row,
        )
    if {"compiled", "hf-generate"} <= set(rows):
        ratio = rows["compiled"]["tokens_per_s"] / rows["hf-generate"]["tokens_per_s"]
        print(f"ratio: tok/s compiled / hf-generate = {ratio:.2f}x")


if __name__ == "__main__":
    main()
