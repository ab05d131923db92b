"""`python -m trl_a3po.plot` draws the paper's figures from runs' logs (hand-written here, in the Trainer's format)."""

import json

import pytest
import torch
from PIL import Image

from trl_a3po import A3POConfig
from trl_a3po.plot import FIGURES, load_history, main, mean_band, run_label, series


def write_run(tmp_path, name, decoupled=True, **config):
    """A run folder as the Trainer leaves it: trainer_state.json (4 optimizer steps, 2 per generation batch, reward
    logged on the first step of each batch, wall clock on every step) and training_args.bin (the pickled config)."""
    folder = tmp_path / name
    folder.mkdir()
    history = []
    for step in range(1, 5):
        entry = {
            "step": step,
            "a3po/wall_time_s": 10.0 * step,
            "entropy": 1.0 / step,
            "a3po/prox_time_s": 0.001,
            "clip_ratio/region_mean": 0.01 * step,
            "a3po/behav_imp_weight/max": 1.0 + 0.1 * step,
            "a3po/behav_imp_weight/min": 1.0 - 0.1 * step,
        }
        if step % 2 == 1:
            entry.update({"reward": 0.1 * step, "rewards/gsm8k_accuracy_reward/mean": 0.05 * step})
        if not decoupled:  # the coupled loss logs none of the decoupled loss's metrics
            entry = {k: v for k, v in entry.items() if not k.startswith("a3po/") or k == "a3po/wall_time_s"}
        history.append(entry)
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    torch.save(
        A3POConfig(
            output_dir=str(folder), use_decoupled_loss=decoupled, report_to="none", use_cpu=True, bf16=False, **config
        ),
        folder / "training_args.bin",
    )
    return folder


def test_plot_command_writes_every_figure_from_run_logs(tmp_path, capsys):
    runs = [
        write_run(tmp_path, "a", prox_logp_method="loglinear"),
        write_run(tmp_path, "b", prox_logp_method="recompute"),
        write_run(tmp_path, "c", decoupled=False),
    ]
    assert [run_label(str(r)) for r in runs] == ["loglinear", "recompute", "sync"]
    history = load_history(str(runs[0]))
    assert series(history, "reward", "wall") == ([10.0, 30.0], [pytest.approx(0.1), pytest.approx(0.3)])
    assert series(history, "reward", "step") == ([1, 3], [pytest.approx(0.1), pytest.approx(0.3)])
    # the coupled (sync) run draws on the same clock
    assert series(load_history(str(runs[2])), "reward", "wall")[0] == [10.0, 30.0]
    # evaluations written next to the log (benchmarks/learning.py) join the callback's entries, by step
    (runs[0] / "greedy_eval.json").write_text(
        json.dumps([{"step": 4, "accuracy": 0.5}, {"step": 0, "accuracy": 0.25}])
    )
    assert series(load_history(str(runs[0])), "eval/gsm8k_greedy_accuracy", "step") == ([0, 4], [0.25, 0.5])
    main([str(r) for r in runs] + ["--out", str(tmp_path / "figs")])
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(tmp_path / "figs" / f"{name}.png") for name in FIGURES)
    for path in printed:
        with Image.open(path) as image:
            assert image.size[0] > 300 and image.size[1] > 200


def test_greedy_eval_file_with_a_bad_entry_is_named(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5}]}))
    (tmp_path / "greedy_eval.json").write_text(json.dumps([{"step": 0}]))
    with pytest.raises(ValueError, match="greedy_eval.json: entry 0 needs 'step' and 'accuracy'"):
        load_history(str(tmp_path))


def test_seeds_of_one_method_draw_as_mean_and_sample_std():
    seeds = [([1, 2, 3], [0.1, 0.5, 0.9]), ([1, 2, 3], [0.3, 0.5, 0.3]), ([1, 2], [0.2, 0.8])]
    x, mean, std = mean_band(seeds, "step")
    assert x == [1, 2]  # the points every seed has
    assert mean == pytest.approx([0.2, 0.6])
    assert std == pytest.approx([0.1, (0.06 / 2) ** 0.5])  # sample std: sqrt(sum of squares / (n - 1))
    # wall-clock: x is the seeds' mean time at each point
    assert mean_band([([10.0, 20.0], [1.0, 2.0]), ([12.0, 26.0], [3.0, 2.0])], "wall") == (
        [11.0, 23.0],
        [2.0, 2.0],
        [2**0.5, 0.0],
    )
    assert mean_band([([1, 2], [0.5, 0.7])], "step") == ([1, 2], [0.5, 0.7], [0.0, 0.0])
    with pytest.raises(ValueError, match="logged different steps"):
        mean_band([([1, 2], [0.0, 0.0]), ([1, 3], [0.0, 0.0])], "step")


def test_seed_bands_are_clipped_to_the_quantity_range():
    from trl_a3po.plot import RANGES, clipped_band

    # an accuracy of 0.9 +- 0.2 and 0.05 +- 0.1: the band stops at 1 and at 0
    assert clipped_band([0.9, 0.05], [0.2, 0.1], RANGES["rewards/gsm8k_accuracy_reward/mean"]) == (
        [pytest.approx(0.7), 0.0],
        [1.0, pytest.approx(0.15)],
    )
    assert clipped_band([0.01], [0.02], RANGES["a3po/prox_time_s"]) == ([0.0], [0.03])  # no upper limit
    assert clipped_band([-0.5], [1.0], RANGES.get("reward")) == ([-1.5], [0.5])  # the total reward: unclipped


def test_a_log_axis_band_spans_the_lowest_to_the_highest_run():
    from trl_a3po.plot import spread_band

    # two replays' KL: one parts from its reference at step 2, the other at step 3 (mean - std < 0 at both)
    curves = [([1, 2, 3], [1e-9, 1e-3, 1e-2]), ([1, 2, 3, 4], [2e-9, 1e-9, 1e-3, 5e-3])]
    assert spread_band(curves) == ([1e-9, 1e-9, 1e-3], [2e-9, 1e-3, 1e-2])
