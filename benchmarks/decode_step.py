"""Where a compiled decoding step's time goes: the compiled forward alone vs the whole step (logits processors,
sampling, the behaviour log-prob, stopping criteria, HF's loop), per batch size and attention (the decoder's grouped
one, or transformers' SDPA, which under compile repeats the cache per query head). A diagnostic for the decoder.
`--profile FILE`: the kernels of one more call of the last row (torch.profiler, by device time) and its device-busy
share of the wall.

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
    parser.add_argument("--attention", nargs="+", default=["grouped"], choices=["grouped", "sdpa"])
    parser.add_argument("--profile", default=None, help="write the last row's kernel table here")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    for attention in args.attention:
        torch._dynamo.reset()  # each attention compiles its own graphs
        backend, forward_s = make_backend(args, attention)
        for batch in args.batches:
            measure(args, backend, forward_s, attention, batch)
    if args.profile:
        profile(args, backend, args.batches[-1])


def make_backend(args, attention):
    model = build(args.model, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    forward_s = []  # the compiled forward's seconds while timed (None first: not timed)
    get_compiled_call = model.get_compiled_call

    def timed_compiled_call(compile_config):
        call = get_compiled_call(compile_config)

        def timed(*a, **k):
            if not forward_s:
                return call(*a, **k)
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
    if attention == "sdpa":
        model.set_attn_implementation("sdpa")
    return backend, forward_s


def prompts_of(args, batch):
    return [[5 + i % 100] * args.prompt_tokens for i in range(batch)]


def measure(args, backend, forward_s, attention, batch):
    prompts = prompts_of(args, batch)
    backend.generate(prompts, threading.Event())  # compile / capture for this shape
    sync(args.device)
    start = time.perf_counter()
    ids, _ = backend.generate(prompts, threading.Event())
    sync(args.device)
    wall = time.perf_counter() - start
    forward_s.append(None)  # the next call times its compiled forwards (a sync around each)
    backend.generate(prompts, threading.Event())
    timed = forward_s[1:]
    forward_s.clear()
    steps = len(timed)
    row = dict(
        batch=batch,
        attention=attention,
        tokens_per_s=sum(map(len, ids)) / wall,
        step_ms=1000 * wall / max(map(len, ids)),
        forward_ms=1000 * sorted(timed)[len(timed) // 2] if timed else float("nan"),
        compiled_steps=steps,
    )
    print(row, flush=True)
    emit(args.jsonl, "decode_step", model=args.model, **row)


def profile(args, backend, batch):
    """One more call under torch.profiler (the timing wrapper still in place): kernels by device time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prompts = prompts_of(args, batch)
    sync(args.device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        backend.generate(prompts, threading.Event())
        sync(args.device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # kernels only, as the profiler's own table sums them (a user annotation's device range spans its kernels)
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation]
    device_s = sum(event.self_device_time_total for event in kernels) / 1e6
    table = events.table(
        sort_by="self_device_time_total" if args.device == "cuda" else "self_cpu_time_total", row_limit=40
    )
    Path(args.profile).write_text(f"wall {wall:.3f} s, device busy {device_s:.3f} s\n{table}\n")
    print(f"profile: wall {wall:.3f} s, device busy {device_s:.3f} s ({device_s / wall:.0%}) -> {args.profile}")


if __name__ == "__main__":
    main()
