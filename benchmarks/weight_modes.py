"""How much each off-policy correction masks or truncates, on the same short run.

One asynchronous A-3PO run (loglinear, in-process generation, `max_staleness` 3 so that samples reach staleness 2
and 3) records the decoupled loss's inputs for every micro-batch. Its reward is the share of digits in a completion:
a signal from the first step (GSM8K accuracy is 0 for a random model), so the policy moves and stale samples drift.
The loss is a pure function of tensors, so every behaviour-weight option (mode x level x bounds) is then evaluated on
exactly those tensors, and the shares of tokens and of sequences whose weight fell outside the bounds are reported per
staleness.

    python benchmarks/weight_modes.py                 # tiny random model, 24 optimizer steps (~2 minutes on 2 cores)
    python benchmarks/weight_modes.py --model smollm2-135m-instruct --steps 8

Writes the table to stdout and to benchmarks/runs/weight_modes.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer


sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import make_model  # noqa: E402  (the benchmarks' tiny model: random weights, SmolLM2's tokenizer)

import trl_a3po.trainer as trainer_module  # noqa: E402
from trl_a3po import A3POConfig, A3POTrainer, load_gsm8k, resolve_model  # noqa: E402
from trl_a3po.proximal import decoupled_ppo_loss  # noqa: E402


# (name, mode, level, lower bound, cap): the paper's cap; then the other options with a band [0.8, 1.25] narrow
# enough to bite on this short run's drift (weights reach ~[0.6, 1.5] at staleness 3): IcePop-style two-sided mask,
# truncated IS, and the sequence variants (DeepSeek-V3.2-style sequence masking, TRL-style sequence truncation).
OPTIONS = [
    ("mask token, cap 5 (paper, default)", "mask", "token", None, 5.0),
    ("mask token, cap 1.25", "mask", "token", None, 1.25),
    ("mask token, [0.8, 1.25] (two-sided)", "mask", "token", 0.8, 1.25),
    ("truncate token, cap 1.25 (TIS)", "truncate", "token", None, 1.25),
    ("truncate token, [0.8, 1.25]", "truncate", "token", 0.8, 1.25),
    ("mask sequence, [0.8, 1.25]", "mask", "sequence", 0.8, 1.25),
    ("truncate sequence, [0.8, 1.25]", "truncate", "sequence", 0.8, 1.25),
]


def digit_share_reward(completions, **kwargs):
    """Share of digits in each completion: varies within every group, so every step has advantages to follow."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]  # chat prompts: one message each
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def record_run(args) -> list[dict]:
    """Train once; return each micro-batch's loss inputs with its per-sample staleness."""
    records, staleness_seen = [], []
    real_approx, real_loss = trainer_module.approximate_prox_logp, trainer_module.decoupled_ppo_loss

    def approx(method, behav_logp, logp, staleness):
        staleness_seen.append(staleness.detach().cpu())
        return real_approx(method, behav_logp, logp, staleness)

    def loss(logp, prox_logp, behav_logp, advantages, mask, *rest, **options):
        records.append(
            dict(
                logp=logp.detach().cpu(),
                prox=prox_logp.detach().cpu(),
                behav=behav_logp.detach().cpu(),
                advantages=advantages.detach().cpu(),
                mask=mask.detach().cpu(),
                staleness=staleness_seen[-1],
            )
        )
        return real_loss(logp, prox_logp, behav_logp, advantages, mask, *rest, **options)

    trainer_module.approximate_prox_logp, trainer_module.decoupled_ppo_loss = approx, loss
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model("smollm2-135m-instruct" if args.model == "tiny" else args.model)
        )
        config = A3POConfig(
            output_dir=tempfile.mkdtemp(prefix="weight-modes-"),
            max_steps=args.steps,
            per_device_train_batch_size=8,
            num_generations=4,
            steps_per_generation=2,
            max_completion_length=args.completion_tokens,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            max_staleness=args.max_staleness,
            seed=0,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            temperature=1.0,
        )
        trainer = A3POTrainer(
            model=make_model(args.model, tokenizer),
            reward_funcs=digit_share_reward,
            args=config,
            train_dataset=load_gsm8k(args.dataset, "train", limit=256),
            processing_class=tokenizer,
        )
        trainer.train()
    finally:
        trainer_module.approximate_prox_logp, trainer_module.decoupled_ppo_loss = real_approx, real_loss
    return records


def shares(records: list[dict]) -> list[dict]:
    rows = []
    buckets = sorted({int(d) for r in records for d in r["staleness"]})
    for name, mode, level, low, cap in OPTIONS:
        for d in buckets:
            totals = torch.zeros(6)
            for r in records:
                rows_d = r["staleness"] == d
                if not rows_d.any():
                    continue
                _, stats = decoupled_ppo_loss(
                    r["logp"][rows_d],
                    r["prox"][rows_d],
                    r["behav"][rows_d],
                    r["advantages"][rows_d],
                    r["mask"][rows_d],
                    0.2,
                    0.2,
                    behav_imp_weight_cap=cap,
                    behav_imp_weight_mode=mode,
                    behav_imp_weight_min=low,
                    behav_imp_weight_level=level,
                )
                totals += torch.stack(
                    [
                        stats[k]
                        for k in (
                            "num_tokens",
                            "capped_sum",
                            "below_min_sum",
                            "num_seqs",
                            "seq_capped_sum",
                            "seq_below_min_sum",
                        )
                    ]
                ).float()
            tokens, above, below, seqs, seq_above, seq_below = totals.tolist()
            rows.append(
                dict(
                    option=name,
                    staleness=d,
                    tokens=int(tokens),
                    sequences=int(seqs),
                    token_above=above / max(tokens, 1),
                    token_below=below / max(tokens, 1),
                    seq_above=seq_above / max(seqs, 1),
                    seq_below=seq_below / max(seqs, 1),
                )
            )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (random, SmolLM2 tokenizer), or a model / alias")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps (2 per policy version)")
    parser.add_argument("--max-staleness", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--dataset", default="recipes/data/gsm8k")
    parser.add_argument("--out", default="benchmarks/runs/weight_modes.json")
    args = parser.parse_args()

    rows = shares(record_run(args))
    print(
        f"\nmodel={args.model} steps={args.steps} max_staleness={args.max_staleness} lr={args.lr} "
        f"completion_tokens={args.completion_tokens} (shares of tokens / sequences outside the bounds: masked or "
        "truncated as the mode says)"
    )
    print(f"{'option':<38}{'d':>3}{'tokens':>8}{'tok >cap':>10}{'tok <min':>10}{'seq >cap':>10}{'seq <min':>10}")
    for r in rows:
        print(
            f"{r['option']:<38}{r['staleness']:>3}{r['tokens']:>8}{r['token_above']:>10.4f}{r['token_below']:>10.4f}"
            f"{r['seq_above']:>10.4f}{r['seq_below']:>10.4f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
