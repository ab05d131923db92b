"""Batch-granular generation vs in-flight weight updates vs continuous generation, long-tailed completion lengths.

    python benchmarks/inflight.py                                  # in-process, CPU, ~10 min on 2 cores
    python benchmarks/inflight.py --backend vllm_server --vllm-port 8000 --model-dir DIR \
        --modes batch inflight continuous continuous-inflight     # a running vLLM server
    python benchmarks/inflight.py --save-model DIR                 # write the model + tokenizer a server starts from

The workload: a random Qwen2-shaped model (vocab 1024) whose end-of-sequence logit is raised by a constant
(`--eos-bias`), so every token ends the completion with the same probability (~1/16): completion lengths are
geometric, p95 / median ~ 4, capped at `--completion-tokens`. The bias is part of the policy on both sides: the
trainer's forward (a patch of the model class's forward, below) and the generator (the same patch in-process; the
request's `logit_bias` on a vLLM server, which its processed log-probs include), so behaviour log-probs stay exact.
The reward is synthetic. Every mode runs the same seed, data, steps and staleness bound, interleaved `--repeats`
times; the medians are compared.

Modes: `batch` (a generation batch runs to its end with the version it started with; the next version loads between
batches), `inflight` (inflight_weight_updates: a newer version loads between two tokens; unfinished sequences
continue under it), `continuous` (continuous_generation: every batch the bound lets in is generated at once, on a
server as concurrent requests, in-process merged into one `generate`) and `continuous-inflight` (both). Reported per
mode: wall time, trainer wait per training step, generator tokens/s (per batch: its tokens over its time in the
generator), generator idle share (producer time waiting for a request / wall), mean token staleness, the share of
sequences that mix versions, versions loaded (pushed) per run and the completion-length median / p95.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import print_table, shape_dataset, shape_tokenizer, synthetic_reward, train_and_read_log  # noqa: E402

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402
from trl_a3po.rollout import GenerationQueue  # noqa: E402


VOCAB = 1024
EOS = 1  # shape_tokenizer's <eos>


def model_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=EOS,
        bos_token_id=None,
    )


def raise_eos_logit(bias: float) -> None:
    """Every Qwen2ForCausalLM forward in this process adds `bias` to the EOS logit (the trainer's and the in-process
    generator's): the policy trained and the policy sampled are the same biased one."""
    forward = Qwen2ForCausalLM.forward

    @functools.wraps(forward)
    def biased(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits[..., EOS] += bias
        return out

    Qwen2ForCausalLM.forward = biased


def count_loads() -> dict:
    """Count the versions the producer loads (pushes, on a server) in a run."""
    counts = {"loads": 0}
    load = GenerationQueue._load_weights_for

    def counted_load(queue, min_version):
        held = queue._held_version
        seconds = load(queue, min_version)
        counts["loads"] += queue._held_version != held
        return seconds

    GenerationQueue._load_weights_for = counted_load
    return counts


def run(mode: str, args, tokenizer, dataset, loads: dict) -> dict:
    lengths = []

    def reward(completions, completion_ids, **kwargs):
        lengths.extend(len(ids) for ids in completion_ids)
        return synthetic_reward(completions)

    server = {}
    if args.backend == "vllm_server":
        server = dict(rollout_backend="vllm_server", vllm_server_port=args.vllm_port, weight_sync_transport="disk")
    config = A3POConfig(
        output_dir=tempfile.mkdtemp(prefix=f"inflight-{mode}-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=4,
        steps_per_generation=args.steps_per_generation,
        max_completion_length=args.completion_tokens,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        temperature=1.0,
        disable_tqdm=True,
        max_staleness=args.max_staleness,
        inflight_weight_updates=mode.endswith("inflight"),
        continuous_generation=mode.startswith("continuous"),
        **server,
    )
    torch.manual_seed(0)
    model = (
        AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        if args.model_dir
        else AutoModelForCausalLM.from_config(model_config(), dtype=torch.float32)
    )
    reward.__name__ = "synthetic_reward"
    trainer = A3POTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    loads["loads"] = 0
    wall, values = train_and_read_log(trainer)
    lengths.sort()
    return {
        "mode": mode,
        "wall_s": wall,
        "wait_s_per_step": sum(values("a3po/queue/trainer_wait_s")) / len(values("a3po/queue/trainer_wait_s")),
        "gen_tokens_per_s": statistics.mean(values("a3po/gen/tokens_per_s")),
        "gen_idle_share": sum(values("a3po/queue/producer_idle_s")) / wall,
        "token_staleness": statistics.mean(values("a3po/staleness/mean")),
        "mixed_version_frac": statistics.mean(values("a3po/gen/mixed_version_frac")),
        "loads": loads["loads"],
        "length_p50": lengths[len(lengths) // 2],
        "length_p95": lengths[int(len(lengths) * 0.95)],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--eos-bias", type=float, default=4.1, help="added to the EOS logit: hazard ~1/16 per token")
    modes = ["batch", "inflight", "continuous", "continuous-inflight"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per mode, interleaved (batch, inflight, batch, "
        "...): the first run of a process warms caches, and a shared CPU drifts",
    )
    parser.add_argument("--backend", default="inprocess", choices=["inprocess", "vllm_server"])
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--model-dir", help="start from this model (the one the vLLM server serves)")
    parser.add_argument("--save-model", metavar="DIR", help="write the random model + tokenizer here and exit")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()

    tokenizer = shape_tokenizer(VOCAB)
    if args.save_model:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(model_config(), dtype=torch.float32).save_pretrained(args.save_model)
        tokenizer.save_pretrained(args.save_model)
        return
    if args.backend == "vllm_server" and not args.model_dir:
        parser.error("--backend vllm_server needs --model-dir (the model the server was started from: --save-model)")
    raise_eos_logit(args.eos_bias)
    if args.backend == "vllm_server":  # the server applies the same bias to every request
        from trl_a3po.rollout.vllm_server import VLLMServerBackend

        from_config = VLLMServerBackend.from_config.__func__

        def biased_backend(cls, *a, **kw):
            backend = from_config(cls, *a, **kw)
            backend.sampling["logit_bias"] = {str(EOS): args.eos_bias}
            return backend

        VLLMServerBackend.from_config = classmethod(biased_backend)
    loads = count_loads()
    dataset = shape_dataset(VOCAB, args.prompt_tokens)
    results = [run(mode, args, tokenizer, dataset, loads) for _ in range(args.repeats) for mode in args.modes]

    print(
        f"\nbackend={args.backend} steps={args.steps} batch={args.batch} steps_per_generation="
        f"{args.steps_per_generation} completion_tokens<={args.completion_tokens} max_staleness={args.max_staleness}"
        f" eos_bias={args.eos_bias} threads={torch.get_num_threads()}"
    )
    print_table(
        results,
        [
            ("mode", "mode", 20, ""),
            ("wall s", "wall_s", 8, ".1f"),
            ("wait s/step", "wait_s_per_step", 13, ".3f"),
            ("gen tok/s", "gen_tokens_per_s", 11, ".1f"),
            ("gen idle", "gen_idle_share", 10, ".2f"),
            ("token d", "token_staleness", 9, ".3f"),
            ("mixed seq", "mixed_version_frac", 11, ".3f"),
            ("loads", "loads", 7, "d"),
            ("len p50", "length_p50", 9, "d"),
            ("len p95", "length_p95", 9, "d"),
        ],
    )
    median = {
        mode: {
            key: statistics.median(r[key] for r in results if r["mode"] == mode)
            for key in ("wall_s", "wait_s_per_step", "gen_tokens_per_s", "token_staleness")
        }
        for mode in args.modes
    }
    for mode, m in median.items():
        print(
            f"median of {args.repeats} {mode}: wall {m['wall_s']:.1f} s, wait {m['wait_s_per_step']:.3f} s/step, "
            f"{m['gen_tokens_per_s']:.1f} gen tok/s, token staleness {m['token_staleness']:.3f}"
        )
    for mode in args.modes[1:]:
        print(f"median wall {args.modes[0]}/{mode} = {median[args.modes[0]]['wall_s'] / median[mode]['wall_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
