"""Train on a recording's generation batches again, with another proximal anchor (`ReplayTrainer`).

Why: the proximal anchor is the one thing the A-3PO approximation changes, and in a closed loop each run samples its
own data, which buries that change under sampling noise. A recording (`A3POConfig.record_generation_batches`, format
in `recording.py`) fixes the data: every learner replayed from it receives the same prompts, completions, behaviour
log-probs, per-token versions and advantages, in the same order and micro-batches, at the same staleness; only the
anchor differs. A replay is not a closed loop: it measures how far the anchor alone moves learning, on data the
learners did not all choose.

    args = replay_config("recording/", "loglinear", "outputs/replay-loglinear")
    ReplayTrainer(model_the_recorded_run_started_from, args=args, train_dataset=its_dataset,
                  recording="recording/", anchor="loglinear").train()
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import TrainerState
from transformers.trainer_utils import get_last_checkpoint

from .config import A3POConfig
from .proximal import PROX_APPROXIMATIONS
from .recording import Recording, policy_fingerprint
from .trainer import A3POTrainer


# What a replay may train with: recompute (decoupled PPO's forward per training step) or one of the approximations,
# loglinear (A-3PO), linear, rollout (the behaviour policy itself, as TRL's AsyncGRPOTrainer anchors its ratio).
ANCHORS = ("recompute", *PROX_APPROXIMATIONS)
# The fields that decide which rows of a recorded batch reach which micro-batch and optimizer step: a replay must
# keep them. (Optimizer, schedule and loss options are a replay's to vary; `replay_config` copies them by default.)
DATA_LAYOUT_FIELDS = (
    "seed",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "num_generations",
)


def check_layout(recording: Recording, args: A3POConfig, num_processes: int) -> None:
    """A replay's config must cut the recorded batches as the recorded run did."""
    if num_processes != recording.manifest["num_processes"]:
        raise ValueError(
            f"{recording.directory} was recorded by {recording.manifest['num_processes']} processes; replay it "
            f"with as many (this run has {num_processes})."
        )
    for name in DATA_LAYOUT_FIELDS:
        if getattr(args, name) != recording.config[name]:
            raise ValueError(
                f"{name}={getattr(args, name)!r}, but {recording.directory} was recorded with {name}="
                f"{recording.config[name]!r}: it decides which recorded rows reach which micro-batch; keep it (or "
                "build the config with trl_a3po.replay.replay_config)."
            )


def replay_config(recording: str, anchor: str, output_dir: str, **overrides) -> A3POConfig:
    """The recorded run's A3POConfig for a replay with `anchor`: everything as recorded (data layout, optimizer,
    schedule, loss options), the anchor's `prox_logp_method`, no recording, `output_dir`, then `overrides`."""
    if anchor not in ANCHORS:
        raise ValueError(f"anchor={anchor!r}: expected one of {ANCHORS}.")
    recorded = Recording(recording).config
    init_fields = {f.name for f in dataclasses.fields(A3POConfig) if f.init}
    values = {key: value for key, value in recorded.items() if key in init_fields}
    values.update(
        generation_batch_size=None,  # GRPOConfig derived it from steps_per_generation, and refuses both
        reward_weights=None,  # a replay computes no rewards (the recorded weights are in the manifest)
        output_dir=output_dir,
        prox_logp_method="recompute" if anchor == "recompute" else "loglinear",
        record_generation_batches=None,
        **overrides,
    )
    for key in [key for key, value in values.items() if isinstance(value, str) and value.startswith("<")]:
        del values[key]  # tokens TrainingArguments.to_dict() hid as "<HUB_TOKEN>" and the like
    return A3POConfig(**values)


def _no_rewards(prompts, completions, **kwargs):
    raise RuntimeError("a replay computes no rewards: the recorded advantages are trained")


class ReplayTrainer(A3POTrainer):
    """Trains on a recording's generation batches, in the recorded order and micro-batches, at their recorded
    per-token versions, with `anchor` as the proximal policy; generates nothing. Starts from the recording's initial
    weights (checked against the manifest's fingerprint)."""

    def __init__(
        self,
        model,
        args: A3POConfig | None = None,
        train_dataset=None,
        *,
        recording: str,
        anchor: str,
        **kwargs,
    ):
        if anchor not in ANCHORS:
            raise ValueError(f"anchor={anchor!r}: expected one of {ANCHORS}.")
        if args is None:
            raise ValueError("ReplayTrainer needs `args`: build them with trl_a3po.replay.replay_config.")
        wanted_method = "recompute" if anchor == "recompute" else "loglinear"
        if args.prox_logp_method != wanted_method or args.record_generation_batches is not None:
            raise ValueError(
                f"anchor={anchor!r} needs prox_logp_method={wanted_method!r} and record_generation_batches=None (got "
                f"{args.prox_logp_method!r}, {args.record_generation_batches!r}); replay_config sets both."
            )
        if not (args.async_generation and args.use_decoupled_loss):
            raise ValueError(
                "a replay trains the decoupled loss on asynchronous batches, as recorded: use replay_config."
            )
        self.recording = Recording(recording)
        # No reward functions: the recorded advantages are trained (GRPOTrainer needs one; it is never called).
        super().__init__(model, _no_rewards, args=args, train_dataset=train_dataset, **kwargs)
        check_layout(self.recording, self.args, self.accelerator.num_processes)
        self._prox_approximation = anchor if anchor != "recompute" else "loglinear"
        fingerprint = policy_fingerprint(self.accelerator.unwrap_model(self.model))
        if fingerprint != self.recording.manifest["initial_weights"]:
            raise ValueError(
                f"the model's weights are not {recording}'s initial weights (parameter fingerprint {fingerprint[:12]} "
                f"vs {self.recording.manifest['initial_weights'][:12]}): start from the model the recorded run "
                "started from."
            )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint and self.args.prox_logp_method == "recompute":
            self._check_resumable(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _check_resumable(self, checkpoint) -> None:
        """Recompute's anchor is the weights at the start of a generation batch's training step; a checkpoint inside
        one holds later weights, and a replay resumed there would anchor the rest of the batch differently from the
        run it replays."""
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        state_path = os.path.join(str(checkpoint), "trainer_state.json")
        if checkpoint is None or not os.path.exists(state_path):
            return  # the Trainer's own error names it
        step = TrainerState.load_from_json(state_path).global_step
        per_version = self._optimizer_steps_per_version
        if step % per_version:
            raise ValueError(
                f"{checkpoint} was saved after optimizer step {step}, inside a generation batch ({per_version} "
                "optimizer steps each): recompute's proximal policy is the weights at the batch's start, which it "
                f"does not hold. Resume from a checkpoint at a multiple of {per_version} (save_steps={per_version})."
            )

    def _start_rollout(self):
        return None  # nothing is generated

    def _scored_generation_batch(self, inputs) -> dict:
        if not self.model.training:
            raise NotImplementedError("a replay has no generator to evaluate with; evaluate its saved model instead")
        index = self._generation_batch_index
        if index != self.policy_version:
            raise RuntimeError(f"generation batch {index} would be trained by policy version {self.policy_version}")
        batch = self.recording.batch(index, self.accelerator.process_index)
        rewards_per_func = batch.pop("rewards_per_func")
        if rewards_per_func is not None:  # TRL's reward metrics, from the recorded rewards
            weights = torch.tensor(self.recording.manifest["reward_weights"], dtype=rewards_per_func.dtype)
            self._metrics["train"]["reward"].append((rewards_per_func * weights).nansum(dim=1).mean().item())
            for i, name in enumerate(self.recording.manifest["reward_func_names"]):
                self._metrics["train"][f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
        device = self.accelerator.device
        return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
