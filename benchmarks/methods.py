"""sync vs recompute vs loglinear (and plain TRL GRPOTrainer), same model, data, seed and steps, in one run.

    python benchmarks/methods.py                                   # tiny random model, SmolLM2's tokenizer, CPU
    python benchmarks/methods.py --model smollm2-135m-instruct --steps 8   # ~20 min on 2 CPU cores (5 x 8 steps)
    python benchmarks/methods.py --backend vllm_server --vllm-port 8000   # generation on a running vLLM server
    python benchmarks/methods.py --model qwen2.5-1.5b-shape --methods sync recompute loglinear loglinear-noahead \
        --batch 8 --gradient-accumulation-steps 2 --steps-per-generation 8 --prompt-tokens 128 \
        --completion-tokens 512 --steps 12 --gradient-checkpointing     # one GPU, the paper's model shape

A `*-shape` model (benchmarks/prox_cost.py's SHAPES; `tiny-shape` for a CPU smoke run) is randomly initialised with a
synthetic word-level tokenizer of its vocabulary size, random prompts of `--prompt-tokens` words and a synthetic
reward: no hub, dataset or math-verify needed (what the lent GPU machine has), and a random model almost never
samples EOS, so every completion is `--completion-tokens` long.

Methods: `grpo` (trl.GRPOTrainer), `sync` (A3POTrainer, coupled loss, no queue: the paper's baseline),
`recompute` (queue + decoupled loss, proximal forward per batch) and `loglinear` (queue + A-3PO). Prints each
method's median optimizer-step time, generated tokens/s, proximal time per step, trainer time waiting for data,
and the ratios. Medians skip the first generation batch (warm-up).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulated_engine  # noqa: E402
from prox_cost import SHAPES  # noqa: E402
from report import emit  # noqa: E402

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402


METHODS = {
    "grpo": dict(trainer=GRPOTrainer, config=GRPOConfig),
    "sync": dict(use_decoupled_loss=False, async_generation=False),
    "recompute": dict(prox_logp_method="recompute", async_generation=True),
    "loglinear": dict(prox_logp_method="loglinear", async_generation=True),
    # the same code path with max_staleness=0: the producer cannot run ahead, so generation (in-process or on the
    # server) and training take turns: the synchronous schedule, A-3PO's loss
    "loglinear-noahead": dict(prox_logp_method="loglinear", async_generation=True, max_staleness=0),
    # generated ahead on a vLLM engine in the training process (TRL's use_vllm=True, vllm_mode="colocate"; vLLM must
    # be installed beside the trainer), instead of the in-process HF generate of the methods above
    "loglinear-colocate": dict(
        prox_logp_method="loglinear",
        async_generation=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
    ),
}


def shape_config(name: str):
    return SHAPES["tiny" if name == "tiny-shape" else name]()


def shape_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab_size` tokens (`<pad>`, `<eos>`, `<unk>`, then w3, w4, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def shape_dataset(vocab_size: int, prompt_tokens: int, rows: int = 256) -> Dataset:
    rng = random.Random(0)
    return Dataset.from_dict(
        {"prompt": [" ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(prompt_tokens)) for _ in range(rows)]}
    )


def synthetic_reward(completions, **kwargs):
    """Spread within each group, so advantages are not all zero: a function of each completion's text."""
    return [(sum(map(ord, text)) % 13) / 13 for text in completions]


def make_model(name: str, tokenizer):
    if name.endswith("-shape"):
        torch.manual_seed(0)
        config = shape_config(name)
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        # Built on the device itself: a random 1.5B model initialised on a slow host CPU takes a minute or more.
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            return AutoModelForCausalLM.from_config(
                config, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32
            )
    from trl_a3po import resolve_model

    if name == "tiny":
        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32)


def run(method: str, args, tokenizer, dataset) -> dict:
    spec = dict(METHODS[method])
    trainer_cls, config_cls = spec.pop("trainer", A3POTrainer), spec.pop("config", A3POConfig)
    if method == "sync" and args.backend == "emulated":  # the synchronous schedule on that engine, coupled loss
        spec.update(async_generation=True, max_staleness=0)
    if config_cls is A3POConfig and spec.get("async_generation"):
        spec.setdefault("max_staleness", args.max_staleness)
        if args.backend == "vllm_server":
            spec.update(rollout_backend="vllm_server", vllm_server_port=args.vllm_port, weight_sync_transport="disk")
        elif args.backend == "emulated":
            spec.update(rollout_backend=emulated_engine.register(args.engine_rate))
    config = config_cls(
        output_dir=tempfile.mkdtemp(prefix=f"bench-{method}-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=4,
        steps_per_generation=args.steps_per_generation,
        max_completion_length=args.completion_tokens,
        learning_rate=1e-6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        temperature=1.0,
        disable_tqdm=True,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing,
        **spec,
    )
    if args.model.endswith("-shape"):
        reward = synthetic_reward
    else:
        from trl_a3po import gsm8k_accuracy_reward  # math-verify: only for the GSM8K runs

        reward = gsm8k_accuracy_reward
    model = make_model(args.model, tokenizer)
    if spec.get("vllm_mode") == "colocate":  # vLLM builds its engine from a checkpoint: the same weights, saved
        folder = os.path.join(config.output_dir, "checkpoint")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    clock = StepClock()
    trainer.add_callback(clock)
    busy = GPUBusy()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with busy:
        wall, values = train_and_read_log(trainer)
    history = trainer.state.log_history
    # the first generation batch (its optimizer steps): warm-up, and nothing to overlap with yet
    skip = args.steps_per_generation // args.gradient_accumulation_steps
    step_times = values("step_time")[skip:] or values("step_time")
    tokens = sum(
        h["completions/mean_length"] * args.batch * args.steps_per_generation
        for h in history
        if "completions/mean_length" in h
    )
    per_version = args.steps_per_generation // args.gradient_accumulation_steps  # optimizer steps per version
    version_s = clock.steady_seconds_per(per_version)
    prox_per_step = statistics.mean(values("a3po/prox_time_s")) if values("a3po/prox_time_s") else float("nan")
    gen_rates = values("a3po/gen/tokens_per_s")[1:] or values("a3po/gen/tokens_per_s")
    result = {
        "method": method,
        "step_s": statistics.median(step_times),
        "tokens_per_s": tokens / wall,
        "prox_s": statistics.median(values("a3po/prox_time_s")) if values("a3po/prox_time_s") else float("nan"),
        "prox_mean_s": prox_per_step,
        "wait_s": sum(values("a3po/queue/trainer_wait_s")[1:]) / max(len(step_times), 1),
        "wall_s": wall,
        # per version (generation batch) after the first one: the steady state, compilation and warm-up excluded
        "version_s": version_s,
        "prox_share": prox_per_step * per_version / version_s if version_s == version_s else float("nan"),
        "generator_tokens_per_s": statistics.median(gen_rates) if gen_rates else float("nan"),
        "trainer_idle": mean_or_nan(values("trainer/idle_ratio")[1:]),
        "generator_idle": mean_or_nan(values("rollouter/idle_ratio")[1:]),
        "gpu_busy": busy.share,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"),
    }
    emit(
        args.jsonl,
        args.table,
        model=args.model,
        backend=args.backend,
        engine_rate=args.engine_rate if args.backend == "emulated" else None,
        batch=args.batch,
        steps_per_generation=args.steps_per_generation,
        completion_tokens=args.completion_tokens,
        **result,
    )
    del trainer
    gc.collect()
    return result


def mean_or_nan(xs):
    return statistics.mean(xs) if xs else float("nan")


class StepClock(TrainerCallback):
    """When each optimizer step ended: the steady seconds per version, the first version (compilation, warm-up)
    excluded."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def steady_seconds_per(self, steps_per_version: int) -> float:
        marks = self.ends[steps_per_version - 1 :: steps_per_version]  # the end of each version
        if len(marks) < 2:
            return float("nan")
        return (marks[-1] - marks[0]) / (len(marks) - 1)


class GPUBusy:
    """The share of 0.2 s samples in which nvidia-smi's utilisation counter read busy (mean percent / 100), while
    training runs; NaN without CUDA or NVML."""

    def __init__(self):
        self.samples, self.done, self.thread = [], threading.Event(), None

    def __enter__(self):
        if torch.cuda.is_available():
            try:
                torch.cuda.utilization()
            except Exception:  # no NVML here: no samples
                return self
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.2):
            self.samples.append(torch.cuda.utilization())

    def __exit__(self, *exc):
        self.done.set()
        if self.thread is not None:
            self.thread.join()

    @property
    def share(self) -> float:
        return statistics.mean(self.samples) / 100 if self.samples else float("nan")


def train_and_read_log(trainer):
    """Train; return the wall-clock seconds and a reader of every logged value of one key."""
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = trainer.state.log_history
    return wall, lambda key: [h[key] for h in history if key in h]


def print_table(rows: list[dict], columns: list[tuple[str, str, int, str]]) -> None:
    """A plain-text table: `columns` are (title, key, width, format); the first column left-aligned."""

    def line(cells):
        return "".join(
            f"{cell:<{width}}" if i == 0 else f"{cell:>{width}}"
            for i, (cell, (_, _, width, _)) in enumerate(zip(cells, columns))
        )

    header = line([title for title, _, _, _ in columns])
    print(header)
    print("-" * len(header))
    for row in rows:
        print(line([format(row[key], spec) for _, key, _, spec in columns]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny (random, SmolLM2 tokenizer), a model / alias, or a "
        f"random *-shape model: tiny-shape, {', '.join(k for k in SHAPES if k != 'tiny')}",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=list(METHODS),
        help="default: every method but loglinear-colocate (it needs vLLM installed); with --backend emulated, sync "
        "recompute loglinear (the others would not generate on it)",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (samples per step)")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="*-shape models: words per random prompt")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--backend",
        default="inprocess",
        choices=["inprocess", "vllm_server", "emulated"],
        help="emulated: benchmarks/emulated_engine.py, a stand-in for an engine on other GPUs (no GPU used) that "
        "returns --completion-tokens per row at --engine-rate tokens/s; `sync` then means the producer with "
        "max_staleness=0 and the coupled loss",
    )
    parser.add_argument(
        "--engine-rate",
        type=float,
        default=emulated_engine.DEFAULT_RATE,
        help=f"the emulated engine's generated tokens/s (default {emulated_engine.DEFAULT_RATE:.0f}: the A-3PO "
        "paper's setup 1 as reconstructed in issue 45, 256 x 1,024 tokens in ~35 s; not a published vLLM figure: the "
        "one found for Qwen2.5-1.5B, 2,195 output tok/s on an A100 with 1,000 / 2,000 tokens in / out (PR 1 of "
        "github.com/simon-mo/vLLM-Benchmark), is a serving benchmark's, not a rollout batch's)",
    )
    parser.add_argument("--jsonl", default=None, help="also append each method's row to this JSON-lines file")
    parser.add_argument("--table", default="methods", help="the table name written in each JSON line")
    parser.add_argument("--max-staleness", type=int, default=None, help="eta for the async methods (default: auto)")
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--dataset", default="recipes/data/gsm8k")
    parser.add_argument(
        "--save-tiny",
        metavar="DIR",
        help="write the tiny model + tokenizer here (for a vLLM server to start from) and exit",
    )
    args = parser.parse_args()

    if args.model.endswith("-shape"):
        vocab_size = shape_config(args.model).vocab_size
        tokenizer, dataset = shape_tokenizer(vocab_size), shape_dataset(vocab_size, args.prompt_tokens)
    else:
        from trl_a3po import load_gsm8k, resolve_model

        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model("smollm2-135m-instruct" if args.model == "tiny" else args.model)
        )
        dataset = load_gsm8k(args.dataset, "train", limit=256)
    if args.save_tiny:
        make_model("tiny", tokenizer).save_pretrained(args.save_tiny)
        tokenizer.save_pretrained(args.save_tiny)
        return
    if args.methods is None:
        args.methods = (
            ["sync", "recompute", "loglinear"]
            if args.backend == "emulated"
            else [method for method in METHODS if method != "loglinear-colocate"]
        )
    results = [run(method, args, tokenizer, dataset) for method in args.methods]

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"\nmodel={args.model} device={device} backend={args.backend} steps={args.steps} batch={args.batch} "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps} "
        f"steps_per_generation={args.steps_per_generation} completion_tokens={args.completion_tokens} "
        f"max_staleness={args.max_staleness or 'auto'} threads={torch.get_num_threads()}"
    )
    print_table(
        results,
        [
            ("method", "method", 18, ""),
            ("step s (median)", "step_s", 16, ".3f"),
            ("gen tok/s", "tokens_per_s", 11, ".1f"),
            ("prox s/step (median)", "prox_s", 22, ".6f"),
            ("prox s/step (mean)", "prox_mean_s", 20, ".6f"),
            ("wait s/step", "wait_s", 13, ".3f"),
            ("s/version", "version_s", 11, ".2f"),
            ("trainer idle", "trainer_idle", 14, ".2f"),
            ("gen idle", "generator_idle", 10, ".2f"),
            ("GPU busy", "gpu_busy", 10, ".2f"),
            ("peak GB", "peak_memory_gb", 9, ".1f"),
            ("wall s", "wall_s", 9, ".1f"),
        ],
    )
    by = {r["method"]: r for r in results}
    ratios = []
    if "sync" in by and "loglinear" in by:
        ratios.append(f"wall sync/loglinear = {by['sync']['wall_s'] / by['loglinear']['wall_s']:.2f}x")
    if "loglinear-noahead" in by and "loglinear" in by:
        ratios.append(
            f"wall loglinear-noahead/loglinear (the asynchrony alone) = "
            f"{by['loglinear-noahead']['wall_s'] / by['loglinear']['wall_s']:.2f}x"
        )
    if "recompute" in by and "loglinear" in by:
        ratios.append(f"wall recompute/loglinear = {by['recompute']['wall_s'] / by['loglinear']['wall_s']:.2f}x")
        ratios.append(
            f"prox time (mean) recompute/loglinear = "
            f"{by['recompute']['prox_mean_s'] / by['loglinear']['prox_mean_s']:.0f}x"
        )
    for slow in ("sync", "loglinear-noahead", "recompute"):
        if slow in by and "loglinear" in by:
            ratios.append(f"s/version {slow}/loglinear = {by[slow]['version_s'] / by['loglinear']['version_s']:.2f}x")
    if "grpo" in by and "sync" in by:
        ratios.append(f"step sync(A3POTrainer)/GRPOTrainer = {by['sync']['step_s'] / by['grpo']['step_s']:.3f}x")
    print("ratios: " + "; ".join(ratios))


if __name__ == "__main__":
    main()
