"""sync vs recompute vs loglinear (and plain TRL GRPOTrainer), same model, data, seed and steps, in one run.

    python benchmarks/methods.py                                   # tiny random model, SmolLM2's tokenizer, CPU
    python benchmarks/methods.py --model smollm2-135m-instruct --steps 8   # ~20 min on 2 CPU cores (5 methods x 8 steps)
    python benchmarks/methods.py --backend vllm_server --vllm-port 8000   # generation on a running vLLM server

Methods: `grpo` (trl.GRPOTrainer), `sync` (A3POTrainer, coupled loss, no queue: the paper's baseline),
`recompute` (queue + decoupled loss, proximal forward per batch) and `loglinear` (queue + A-3PO). Prints each
method's median optimizer-step time, generated tokens/s, proximal time per step, trainer time waiting for data,
and the ratios. Medians skip the first generation batch (warm-up).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
from trl import GRPOConfig, GRPOTrainer

from trl_a3po import A3POConfig, A3POTrainer, gsm8k_accuracy_reward, load_gsm8k, resolve_model

METHODS = {
    "grpo": dict(trainer=GRPOTrainer, config=GRPOConfig),
    "sync": dict(use_decoupled_loss=False, async_generation=False),
    "recompute": dict(prox_logp_method="recompute", async_generation=True),
    "loglinear": dict(prox_logp_method="loglinear", async_generation=True),
    # the same code path with max_staleness=0: the producer cannot run ahead, so generation (in-process or on the
    # server) and training take turns: the synchronous schedule, A-3PO's loss
    "loglinear-noahead": dict(prox_logp_method="loglinear", async_generation=True, max_staleness=0),
}


def make_model(name: str, tokenizer):
    if name == "tiny":
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32)


def run(method: str, args, tokenizer, dataset) -> dict:
    spec = dict(METHODS[method])
    trainer_cls, config_cls = spec.pop("trainer", A3POTrainer), spec.pop("config", A3POConfig)
    if config_cls is A3POConfig and spec.get("async_generation"):
        spec.setdefault("max_staleness", args.max_staleness)
        if args.backend == "vllm_server":
            spec.update(rollout_backend="vllm_server", vllm_server_port=args.vllm_port, weight_sync_transport="disk")
    config = config_cls(
        output_dir=tempfile.mkdtemp(prefix=f"bench-{method}-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=4, steps_per_generation=args.steps_per_generation,
        max_completion_length=args.completion_tokens, learning_rate=1e-6, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        temperature=1.0, disable_tqdm=True, **spec,
    )
    trainer = trainer_cls(model=make_model(args.model, tokenizer), reward_funcs=gsm8k_accuracy_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = trainer.state.log_history

    def values(key):
        return [h[key] for h in history if key in h]

    skip = args.steps_per_generation  # the first generation batch: warm-up, and nothing to overlap with yet
    step_times = values("step_time")[skip:] or values("step_time")
    tokens = sum(h["completions/mean_length"] * args.batch * args.steps_per_generation
                 for h in history if "completions/mean_length" in h)
    result = {
        "method": method,
        "step_s": statistics.median(step_times),
        "tokens_per_s": tokens / wall,
        "prox_s": statistics.median(values("a3po/prox_time_s")) if values("a3po/prox_time_s") else float("nan"),
        "prox_mean_s": statistics.mean(values("a3po/prox_time_s")) if values("a3po/prox_time_s") else float("nan"),
        "wait_s": sum(values("a3po/queue/trainer_wait_s")[1:]) / max(len(step_times), 1),
        "wall_s": wall,
    }
    del trainer
    gc.collect()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (random, SmolLM2 tokenizer), or a model / alias")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (samples per step)")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--backend", default="inprocess", choices=["inprocess", "vllm_server"])
    parser.add_argument("--max-staleness", type=int, default=None, help="eta for the async methods (default: auto)")
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--dataset", default="recipes/data/gsm8k")
    parser.add_argument("--save-tiny", metavar="DIR", help="write the tiny model + tokenizer here (for a vLLM server "
                        "to start from) and exit")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct" if args.model == "tiny"
                                                            else args.model))
    if args.save_tiny:
        make_model("tiny", tokenizer).save_pretrained(args.save_tiny)
        tokenizer.save_pretrained(args.save_tiny)
        return
    dataset = load_gsm8k(args.dataset, "train", limit=256)
    results = [run(method, args, tokenizer, dataset) for method in args.methods]

    print(f"\nmodel={args.model} backend={args.backend} steps={args.steps} batch={args.batch} "
          f"steps_per_generation={args.steps_per_generation} completion_tokens={args.completion_tokens} "
          f"max_staleness={args.max_staleness or 'auto'} threads={torch.get_num_threads()}")
    header = (f"{'method':<11}{'step s (median)':>16}{'gen tok/s':>11}{'prox s/step (median)':>22}"
              f"{'prox s/step (mean)':>20}{'wait s/step':>13}{'wall s':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['method']:<11}{r['step_s']:>16.3f}{r['tokens_per_s']:>11.1f}{r['prox_s']:>22.6f}"
              f"{r['prox_mean_s']:>20.6f}{r['wait_s']:>13.3f}{r['wall_s']:>9.1f}")
    by = {r["method"]: r for r in results}
    ratios = []
    if "sync" in by and "loglinear" in by:
        ratios.append(f"wall sync/loglinear = {by['sync']['wall_s'] / by['loglinear']['wall_s']:.2f}x")
    if "loglinear-noahead" in by and "loglinear" in by:
        ratios.append(f"wall loglinear-noahead/loglinear (the asynchrony alone) = "
                      f"{by['loglinear-noahead']['wall_s'] / by['loglinear']['wall_s']:.2f}x")
    if "recompute" in by and "loglinear" in by:
        ratios.append(f"wall recompute/loglinear = {by['recompute']['wall_s'] / by['loglinear']['wall_s']:.2f}x")
        ratios.append(f"prox time (mean) recompute/loglinear = "
                      f"{by['recompute']['prox_mean_s'] / by['loglinear']['prox_mean_s']:.0f}x")
    if "grpo" in by and "sync" in by:
        ratios.append(f"step sync(A3POTrainer)/GRPOTrainer = {by['sync']['step_s'] / by['grpo']['step_s']:.3f}x")
    print("ratios: " + "; ".join(ratios))


if __name__ == "__main__":
    main()
