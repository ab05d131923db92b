"""`python -m trl_a3po.plot` draws the paper's figures from real (short) runs' logs."""

import json

import pytest

from conftest import digit_reward, make_model
from PIL import Image
from test_trainer import COMMON

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.plot import FIGURES, load_history, main, mean_band, series


def short_run(tmp_path, tokenizer, dataset, name, **kwargs):
    args = A3POConfig(output_dir=str(tmp_path / name), max_steps=4, steps_per_generation=2, **{**COMMON, **kwargs})
    trainer = A3POTrainer(model=make_model(tokenizer), reward_funcs=digit_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return tmp_path / name


def test_plot_command_writes_every_figure_from_run_logs(tmp_path, tokenizer, prompt_dataset, capsys):
    runs = [
        short_run(tmp_path, tokenizer, prompt_dataset, "a", prox_logp_method="loglinear"),
        short_run(tmp_path, tokenizer, prompt_dataset, "b", prox_logp_method="recompute"),
        short_run(tmp_path, tokenizer, prompt_dataset, "c", use_decoupled_loss=False),
    ]
    history = json.loads((runs[0] / "trainer_state.json").read_text())["log_history"]
    xs, ys = series(history, "reward", "wall")
    assert len(xs) == 2 and all(x > 0 for x in xs)  # two generation batches, on a wall-clock axis
    sync_history = json.loads((runs[2] / "trainer_state.json").read_text())["log_history"]
    xs, _ = series(sync_history, "reward", "wall")
    assert len(xs) == 2 and 0 < xs[0] < xs[1]  # the coupled (sync) run has the same clock
    # evaluations written next to the log (benchmarks/learning.py) join the callback's entries, by step
    (runs[0] / "greedy_eval.json").write_text(json.dumps([{"step": 4, "accuracy": 0.5}, {"step": 0, "accuracy": 0.25}]))
    assert series(load_history(str(runs[0])), "eval/gsm8k_greedy_accuracy", "step") == ([0, 4], [0.25, 0.5])
    capsys.readouterr()  # drop the training logs
    main([str(r) for r in runs] + ["--out", str(tmp_path / "figs")])
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(tmp_path / "figs" / f"{name}.png") for name in FIGURES)
    for path in printed:
        with Image.open(path) as image:
            assert image.size[0] > 300 and image.size[1] > 200
    from trl_a3po.plot import run_label

    assert [run_label(str(r)) for r in runs] == ["loglinear", "recompute", "sync"]


def test_greedy_eval_file_with_a_bad_entry_is_named(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5}]}))
    (tmp_path / "greedy_eval.json").write_text(json.dumps([{"step": 0}]))
    import pytest

    with pytest.raises(ValueError, match="greedy_eval.json: entry 0 needs 'step' and 'accuracy'"):
        load_history(str(tmp_path))


def test_seeds_of_one_method_draw_as_mean_and_sample_std():
    seeds = [([1, 2, 3], [0.1, 0.5, 0.9]), ([1, 2, 3], [0.3, 0.5, 0.3]), ([1, 2], [0.2, 0.8])]
    x, mean, std = mean_band(seeds, "step")
    assert x == [1, 2]  # the points every seed has
    assert mean == pytest.approx([0.2, 0.6])
    assert std == pytest.approx([0.1, (0.06 / 2) ** 0.5])  # sample std: sqrt(sum of squares / (n - 1))
    # wall-clock: x is the seeds' mean time at each point
    assert mean_band([([10.0, 20.0], [1.0, 2.0]), ([12.0, 26.0], [3.0, 2.0])], "wall") == ([11.0, 23.0], [2.0, 2.0],
                                                                                          [2 ** 0.5, 0.0])
    assert mean_band([([1, 2], [0.5, 0.7])], "step") == ([1, 2], [0.5, 0.7], [0.0, 0.0])
    with pytest.raises(ValueError, match="logged different steps"):
        mean_band([([1, 2], [0.0, 0.0]), ([1, 3], [0.0, 0.0])], "step")
