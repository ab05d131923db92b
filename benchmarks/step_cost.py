"""Optimizer-step time with the proximal log-probs by recompute vs loglinear, generation excluded: on the same
batch and model, one step = (recompute: a no-grad forward over the batch) + forward/backward of the decoupled loss
in micro-batches + the optimizer step. Needs torch and transformers only (runs as is on a lent GPU).

    python benchmarks/step_cost.py --model qwen2.5-1.5b-shape --batch 64 --completion-tokens 1024 --device cuda
    python benchmarks/step_cost.py --model tiny --batch 8 --completion-tokens 64          # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from prox_cost import SHAPES, build, recompute, sync  # noqa: E402
from report import emit  # noqa: E402

from trl_a3po.proximal import aggregate_loss, approximate_prox_logp, decoupled_ppo_loss  # noqa: E402


def token_logps(model, ids, completion_len):
    logits = model(input_ids=ids, logits_to_keep=completion_len + 1).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -completion_len:].unsqueeze(-1)).squeeze(-1)


def step(method, model, optimizer, input_ids, behav, advantages, staleness, completion_len, micro_batch):
    prox_s = 0.0
    if method == "recompute":
        sync(str(input_ids.device))
        start = time.perf_counter()
        prox_all = recompute(model, input_ids, torch.ones_like(input_ids), completion_len, micro_batch)
        sync(str(input_ids.device))
        prox_s = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    num_items = behav.numel()
    for start_row in range(0, input_ids.size(0), micro_batch):
        rows = slice(start_row, start_row + micro_batch)
        logp = token_logps(model, input_ids[rows], completion_len)
        t0 = time.perf_counter()
        if method == "recompute":
            prox = prox_all[rows]
        else:
            prox = approximate_prox_logp("loglinear", behav[rows], logp, staleness[rows])
        prox_s += time.perf_counter() - t0
        mask = torch.ones_like(logp, dtype=torch.bool)
        per_token, _ = decoupled_ppo_loss(logp, prox, behav[rows], advantages[rows], mask, 0.2, 0.28, 5.0)
        aggregate_loss(per_token, mask, "dapo", num_items=num_items).backward()
    optimizer.step()
    return prox_s


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=sorted(SHAPES) + ["smollm2-135m-instruct"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--jsonl", default=None, help="also append each row to this JSON-lines file")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    model = build(args.model, args.device, dtype).train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(
        0, model.config.vocab_size, (args.batch, args.prompt_tokens + args.completion_tokens), generator=g
    ).to(args.device)
    behav = (-torch.rand(args.batch, args.completion_tokens, generator=g) * 5).to(args.device)
    advantages = torch.randn(args.batch, generator=g).to(args.device)
    staleness = torch.randint(0, 5, (args.batch,), generator=g).to(args.device)

    results = {}
    for method in ("recompute", "loglinear", "recompute", "loglinear"):  # interleaved: drift hits both alike
        times, proxes = results.setdefault(method, ([], []))
        step(
            method, model, optimizer, input_ids, behav, advantages, staleness, args.completion_tokens, args.micro_batch
        )  # warm-up
        for _ in range(args.steps):
            sync(args.device)
            start = time.perf_counter()
            proxes.append(
                step(
                    method,
                    model,
                    optimizer,
                    input_ids,
                    behav,
                    advantages,
                    staleness,
                    args.completion_tokens,
                    args.micro_batch,
                )
            )
            sync(args.device)
            times.append(time.perf_counter() - start)
    print(
        f"model={args.model} device={args.device} dtype={dtype} batch={args.batch}x"
        f"({args.prompt_tokens}+{args.completion_tokens}) micro_batch={args.micro_batch} steps={2 * args.steps}"
    )
    print(f"{'method':<11}{'step s (median)':>17}{'prox s (median)':>17}")
    for method, (times, proxes) in results.items():
        print(f"{method:<11}{statistics.median(times):>17.4f}{statistics.median(proxes):>17.6f}")
        emit(
            args.jsonl,
            "step",
            model=args.model,
            method=method,
            batch=args.batch,
            completion_tokens=args.completion_tokens,
            step_s=statistics.median(times),
            prox_s=statistics.median(proxes),
        )
    rc, ll = results["recompute"], results["loglinear"]
    print(
        f"ratios: step recompute/loglinear = {statistics.median(rc[0]) / statistics.median(ll[0]):.3f}x; "
        f"prox recompute/loglinear = {statistics.median(rc[1]) / statistics.median(ll[1]):.0f}x"
    )


if __name__ == "__main__":
    main()
