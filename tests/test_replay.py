"""Record and replay (trl_a3po.recording, trl_a3po.replay): a replay of the recorded anchor reproduces the recorded
run exactly on CPU; a replay with another anchor receives the same data, order, versions and advantages, and differs
only in its anchor."""

import json

import pytest
import torch
from testing_utils import generate_two_versions_ahead, logged, make_model, make_trainer

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.replay import ReplayTrainer, replay_config


# 4 policy versions, staleness up to 2; a narrow trust region, so the anchor matters: unclipped, the decoupled loss's
# gradient is A * pi_theta / pi_behav * grad log pi_theta whatever the anchor (w * r = pi_theta / pi_behav)
RECORDED = dict(steps_per_generation=2, max_steps=8, max_staleness=2, epsilon=0.02)


class LossInputs:
    """Every micro-batch that reaches the loss, with the version that trains it (a trainer class mixin)."""

    def _compute_loss(self, model, inputs):
        seen = getattr(self, "loss_inputs", [])
        seen.append((self.policy_version, {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}))
        self.loss_inputs = seen
        loss = super()._compute_loss(model, inputs)
        self.losses = [*getattr(self, "losses", []), loss.item()]  # exact (the logged "loss" is rounded)
        return loss


class RecordingTrainer(LossInputs, A3POTrainer):
    pass


class CheckedReplay(LossInputs, ReplayTrainer):
    pass


@pytest.fixture
def recorded(tmp_path, tokenizer, prompt_dataset):
    """A loglinear run at max_staleness 2 that records its batches, the producer held two versions ahead."""
    make_model(tokenizer).save_pretrained(tmp_path / "initial")
    trainer = make_trainer(
        tmp_path / "run",
        tokenizer,
        prompt_dataset,
        RecordingTrainer,
        model=str(tmp_path / "initial"),
        record_generation_batches=str(tmp_path / "recording"),
        **RECORDED,
    )
    generate_two_versions_ahead(trainer)
    trainer.train()
    return trainer


def replay(tmp_path, tokenizer, dataset, anchor):
    recording = str(tmp_path / "recording")
    trainer = CheckedReplay(
        str(tmp_path / "initial"),
        args=replay_config(recording, anchor, str(tmp_path / anchor)),
        train_dataset=dataset,
        processing_class=tokenizer,
        recording=recording,
        anchor=anchor,
    )
    trainer.train()
    return trainer


def weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_the_recording_holds_each_batch_as_trained(tmp_path, recorded):
    manifest = json.loads((tmp_path / "recording" / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["num_processes"] == 1
    assert manifest["config"]["max_staleness"] == 2 and manifest["reward_func_names"] == ["digit_reward"]
    files = sorted(p.name for p in (tmp_path / "recording" / "batches").iterdir())
    assert files == [f"{k:06d}-0.pt" for k in range(4)]
    staleness_seen = set()
    for k in range(4):
        batch = torch.load(tmp_path / "recording" / "batches" / f"{k:06d}-0.pt", weights_only=True)
        assert "prox_per_token_logps" not in batch  # the anchor is the method's, not the data's
        mask = batch["completion_mask"].bool()
        staleness = k - batch["behavior_version"][mask]
        assert staleness.min() >= 0 and staleness.max() <= 2  # never above the bound
        staleness_seen |= set(staleness.tolist())
        # the recorded rewards are the ones TRL logged for this batch (at the first of its optimizer steps)
        assert batch["rewards_per_func"].shape == (8, 1)
        assert batch["rewards_per_func"].mean().item() == pytest.approx(logged(recorded, "reward")[k], abs=1e-6)
    assert staleness_seen == {0, 1, 2}


def test_replaying_the_recorded_anchor_reproduces_the_run_exactly(tmp_path, tokenizer, prompt_dataset, recorded):
    replayed = replay(tmp_path, tokenizer, prompt_dataset, "loglinear")
    assert replayed.losses == recorded.losses and len(recorded.losses) == 8  # every micro-batch, bit for bit
    assert logged(replayed, "a3po/staleness/mean") == logged(recorded, "a3po/staleness/mean")
    assert logged(replayed, "reward") == pytest.approx(logged(recorded, "reward"), abs=1e-6)
    final, expected = weights(replayed), weights(recorded)
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_another_anchor_changes_only_the_anchor(tmp_path, tokenizer, prompt_dataset, recorded):
    by_anchor = {anchor: replay(tmp_path, tokenizer, prompt_dataset, anchor) for anchor in ("recompute", "rollout")}
    expected = recorded.loss_inputs
    assert len(expected) == 8
    for anchor, trainer in by_anchor.items():
        assert len(trainer.loss_inputs) == len(expected)
        for (version, inputs), (recorded_version, recorded_inputs) in zip(trainer.loss_inputs, expected):
            assert version == recorded_version  # the same per-token staleness
            assert set(inputs) - {"prox_per_token_logps"} == set(recorded_inputs)
            for key, value in recorded_inputs.items():  # the same rows, order, versions, log-probs and advantages
                assert torch.equal(inputs[key], value), (anchor, key)
    # ... and the anchors differ: recompute's is a forward of the current weights, once per training step
    assert all("prox_per_token_logps" in inputs for _, inputs in by_anchor["recompute"].loss_inputs)
    assert max(logged(recorded, "clip_ratio/region_mean")) > 0
    for trainer in by_anchor.values():
        assert trainer.losses != recorded.losses
        assert not all(torch.equal(a, b) for a, b in zip(weights(trainer).values(), weights(recorded).values()))
    # rollout's anchor is the behaviour policy, loglinear's too where alpha = 1 (staleness <= 1): the two learners
    # are the same until the first step with a token at staleness 2, bit for bit
    first_stale = logged(recorded, "a3po/staleness/max").index(2)
    assert first_stale > 0
    assert by_anchor["rollout"].losses[:first_stale] == recorded.losses[:first_stale]


def test_a_replay_resumed_from_a_checkpoint_ends_as_one_run_through(tmp_path, tokenizer, prompt_dataset, recorded):
    # how the replay study's jobs continue after a stopped session (benchmarks/replay_study.py, `resume_point`)
    recording = str(tmp_path / "recording")

    def replay_from(anchor, name, checkpoint=None):
        args = replay_config(recording, anchor, str(tmp_path / name), save_strategy="steps", save_steps=1)
        data = dict(train_dataset=prompt_dataset, processing_class=tokenizer)
        trainer = CheckedReplay(str(tmp_path / "initial"), args=args, **data, recording=recording, anchor=anchor)
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer

    # two optimizer steps per generation batch: recompute resumes between batches, loglinear (whose anchor is
    # computed per micro-batch) anywhere
    for anchor, step in (("recompute", 4), ("loglinear", 3)):
        whole = replay_from(anchor, f"{anchor}-whole")
        resumed = replay_from(anchor, f"{anchor}-resumed", str(tmp_path / f"{anchor}-whole" / f"checkpoint-{step}"))
        assert resumed.losses == whole.losses[step:] and len(whole.losses) == 8
        for (version, inputs), (whole_version, whole_inputs) in zip(resumed.loss_inputs, whole.loss_inputs[step:]):
            assert version == whole_version
            assert [key for key, value in whole_inputs.items() if not torch.equal(inputs[key], value)] == []
        final, expected = weights(resumed), weights(whole)
        assert all(torch.equal(final[name], expected[name]) for name in expected)
    with pytest.raises(ValueError, match=r"checkpoint-3 was saved after optimizer step 3, inside a generation batch"):
        replay_from("recompute", "inside", str(tmp_path / "recompute-whole" / "checkpoint-3"))


def test_a_replay_refuses_another_layout_or_other_initial_weights(tmp_path, tokenizer, prompt_dataset, recorded):
    recording = str(tmp_path / "recording")

    def replay_trainer(model, anchor="loglinear", **config):
        args = replay_config(recording, "loglinear", str(tmp_path / "out"), **config)
        data = dict(train_dataset=prompt_dataset, processing_class=tokenizer)
        return ReplayTrainer(model, args=args, **data, recording=recording, anchor=anchor)

    with pytest.raises(ValueError, match=r"seed=1, but .* was recorded with seed=0"):
        replay_trainer(str(tmp_path / "initial"), seed=1)
    with pytest.raises(ValueError, match="not .*'s initial weights"):
        replay_trainer(make_model(tokenizer, seed=1))
    with pytest.raises(ValueError, match="anchor='recompute' needs prox_logp_method='recompute'"):
        replay_trainer(str(tmp_path / "initial"), anchor="recompute")
    with pytest.raises(FileNotFoundError, match="no recording here"):
        replay_config(str(tmp_path), "loglinear", str(tmp_path / "out"))


def test_recording_needs_the_decoupled_loss_on_asynchronous_batches(tmp_path):
    with pytest.raises(ValueError, match="record_generation_batches records what a replay retrains"):
        A3POConfig(str(tmp_path), use_cpu=True, bf16=False, async_generation=False, record_generation_batches="r")
