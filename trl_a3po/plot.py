"""The paper's figures from training logs: `python -m trl_a3po.plot RUN_DIR [RUN_DIR ...] --out DIR`.

Each RUN_DIR holds a `trainer_state.json` (the recipe saves one; so does every checkpoint). Runs are labelled by
their method (sync / recompute / loglinear / metrics, from the run's saved training arguments) or by
`--labels`. One PNG per figure, one curve per label: runs that share a label (seeds of one method) are drawn as
their mean with a band of +- one standard deviation, clipped to the quantity's range (`RANGES`); on a log axis
(`LOG_AXIS`) the band spans the lowest to the highest run instead (mean - std is below 0 there as soon as the runs
differ by more than their mean, and would draw nothing). One PNG per figure:
  fig1_prox_time.png        seconds spent on proximal log-probs per optimizer step
  fig2_reward_wallclock.png training reward vs wall-clock
  fig2b_reward_step.png     training reward vs optimizer step
  fig2c_accuracy_reward_step.png  its accuracy part (gsm8k_accuracy_reward) vs optimizer step
  fig3_eval_reward.png      greedy eval accuracy vs step (the GreedyEvalCallback's log entries, and the
                            `greedy_eval.json` list of {"step", "accuracy"} that benchmarks/learning.py
                            writes next to trainer_state.json)
  fig4_entropy.png          policy entropy vs step
  fig5_importance_weight.png  behaviour importance weight max and min vs step
  fig6_clipped_tokens.png   fraction of clipped tokens vs step
  fig7_replay_kl.png        a replayed learner's KL to the reference learner vs step (benchmarks/replay_study.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


EVAL_KEY = "eval/gsm8k_greedy_accuracy"
FIGURES = {
    "fig1_prox_time": ("proximal log-prob time per step", "a3po/prox_time_s", "seconds", "step"),
    "fig2_reward_wallclock": ("training reward vs wall-clock", "reward", "reward", "wall"),
    "fig2b_reward_step": ("training reward vs step", "reward", "reward", "step"),
    # the accuracy part alone: a format bonus can lift the total reward while accuracy falls
    "fig2c_accuracy_reward_step": (
        "training accuracy reward vs step",
        "rewards/gsm8k_accuracy_reward/mean",
        "accuracy reward",
        "step",
    ),
    "fig3_eval_reward": ("greedy eval accuracy", EVAL_KEY, "accuracy", "step"),
    "fig4_entropy": ("policy entropy", "entropy", "entropy (nats)", "step"),
    "fig5_importance_weight": (
        "behaviour importance weight",
        ("a3po/behav_imp_weight/max", "a3po/behav_imp_weight/min"),
        "pi_prox / pi_behav",
        "step",
    ),
    "fig6_clipped_tokens": ("clipped tokens per step", "clip_ratio/region_mean", "fraction of tokens", "step"),
    # benchmarks/replay_study.py: KL(reference || this learner) on a held-out set after each optimizer step
    "fig7_replay_kl": ("KL to the reference learner", "replay/kl_reference_learner", "nats per token", "step"),
}

# What each quantity can be: a seed band (mean +- std) is clipped to it, so it never shows an accuracy above 1 or a
# negative time. The total reward is left unclipped: its range depends on the reward functions and their weights.
RANGES = {
    "a3po/prox_time_s": (0.0, None),
    "rewards/gsm8k_accuracy_reward/mean": (0.0, 1.0),
    EVAL_KEY: (0.0, 1.0),
    "entropy": (0.0, None),
    "a3po/behav_imp_weight/max": (0.0, None),
    "a3po/behav_imp_weight/min": (0.0, None),
    "clip_ratio/region_mean": (0.0, 1.0),
    "replay/kl_reference_learner": (0.0, None),
}
# figures drawn on a log y-axis: KLs that grow from ~1e-9 (float rounding) to ~1e-1 over a run
LOG_AXIS = {"fig7_replay_kl"}


def clipped_band(mean: list[float], std: list[float], bounds: tuple[float | None, float | None] | None):
    """(lower, upper) of mean +- std, each clipped to `bounds` ((low, high), either None for no limit)."""
    low, high = bounds or (None, None)
    lower = [m - s if low is None else max(m - s, low) for m, s in zip(mean, std)]
    upper = [m + s if high is None else min(m + s, high) for m, s in zip(mean, std)]
    return lower, upper


def spread_band(curves: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """(lowest, highest) run at each common point (the k-th logged point of every run)."""
    n = min(len(ys) for _, ys in curves)
    return [min(ys[i] for _, ys in curves) for i in range(n)], [max(ys[i] for _, ys in curves) for i in range(n)]


def load_history(run_dir: str) -> list[dict]:
    """The run's log history, plus the evaluations in `greedy_eval.json` when the folder has one."""
    path = run_dir if run_dir.endswith(".json") else os.path.join(run_dir, "trainer_state.json")
    with open(path) as f:
        history = json.load(f)["log_history"]
    extra = os.path.join(os.path.dirname(path), "greedy_eval.json")
    if os.path.exists(extra):
        with open(extra) as f:
            evaluations = json.load(f)
        for index, entry in enumerate(evaluations):
            if not isinstance(entry, dict) or "step" not in entry or "accuracy" not in entry:
                raise ValueError(f"{extra}: entry {index} needs 'step' and 'accuracy', got {entry!r}")
        logged = {h["step"] for h in history if EVAL_KEY in h}  # the callback's own entries win
        history = history + [
            {"step": e["step"], EVAL_KEY: e["accuracy"]} for e in evaluations if e["step"] not in logged
        ]
    return history


def run_label(run_dir: str) -> str:
    """The run's method, from the training arguments the Trainer saved (`sync` when the decoupled loss is off);
    the folder name when there are none."""
    args_path = os.path.join(run_dir, "training_args.bin")
    if os.path.exists(args_path):
        import torch

        args = torch.load(args_path, weights_only=False)  # a pickled A3POConfig, written by this run's Trainer
        if getattr(args, "use_decoupled_loss", True) is False:
            return "sync"
        if hasattr(args, "prox_logp_method"):
            return args.prox_logp_method
    return os.path.basename(os.path.normpath(run_dir))


def series(history: list[dict], key: str, x_axis: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for entry in history:
        if key not in entry:
            continue
        if x_axis == "wall":
            if "a3po/wall_time_s" not in entry:
                continue
            xs.append(entry["a3po/wall_time_s"])
        else:
            xs.append(entry.get("step", len(xs)))
        ys.append(entry[key])
    if x_axis == "step":  # entries from greedy_eval.json come after the log's own
        pairs = sorted(zip(xs, ys), key=lambda pair: pair[0])
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    return xs, ys


def mean_band(curves: list[tuple[list[float], list[float]]], x_axis: str):
    """The seeds of one method -> (x, mean, std) over their common points (the k-th logged point of every seed).
    On the step axis every seed must have logged the same steps; on wall-clock x is the seeds' mean time."""
    n = min(len(xs) for xs, _ in curves)
    if x_axis == "step" and any(xs[:n] != curves[0][0][:n] for xs, _ in curves):
        raise ValueError("runs with the same label logged different steps; give them different --labels")
    x = [statistics.mean(xs[i] for xs, _ in curves) for i in range(n)]
    mean = [statistics.mean(ys[i] for _, ys in curves) for i in range(n)]
    std = [statistics.stdev([ys[i] for _, ys in curves]) if len(curves) > 1 else 0.0 for i in range(n)]
    return x, mean, std


def plot_runs(run_dirs: list[str], out_dir: str, labels: list[str] | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = [load_history(d) for d in run_dirs]
    labels = labels or [run_label(d) for d in run_dirs]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, (title, keys, ylabel, x_axis) in FIGURES.items():
        keys = keys if isinstance(keys, tuple) else (keys,)
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = 0
        for label in dict.fromkeys(labels):  # first-seen order
            group = [history for history, own in zip(histories, labels) if own == label]
            for key in keys:
                curves = [c for c in (series(h, key, x_axis) for h in group) if c[0]]
                if not curves:
                    continue
                xs, mean, std = mean_band(curves, x_axis)
                suffix = f" ({key.rsplit('/', 1)[-1]})" if len(keys) > 1 else ""
                seeds = f", {len(curves)} runs" if len(curves) > 1 else ""
                (line,) = ax.plot(xs, mean, marker="." if len(xs) < 50 else None, label=label + suffix + seeds)
                if len(curves) > 1:
                    band = spread_band(curves) if name in LOG_AXIS else clipped_band(mean, std, RANGES.get(key))
                    ax.fill_between(xs, *band, color=line.get_color(), alpha=0.2, linewidth=0)
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "not in these logs", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=title, xlabel="wall-clock (s)" if x_axis == "wall" else "optimizer step", ylabel=ylabel)
        if name == "fig1_prox_time" and drawn:
            ax.set_yscale("symlog", linthresh=1e-4)
        if name in LOG_AXIS and drawn:
            ax.set_yscale("log")
        if drawn:
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trl_a3po.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run folders (or trainer_state.json files)")
    parser.add_argument("--out", required=True, help="folder for the PNGs")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: the run's method)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error("--labels needs one label per run")
    for path in plot_runs(args.runs, args.out, args.labels):
        print(path)


if __name__ == "__main__":
    main()
