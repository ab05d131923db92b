"""Recording the generation batches a run trains on (`A3POConfig.record_generation_batches`), format 1.

    DIR/manifest.json           {"format": 1, "num_processes": N, "initial_weights": sha256 of the policy's
                                 parameters (name, dtype, shape, bytes) before its first step, "reward_func_names",
                                 "reward_weights", "config": the run's A3POConfig as `to_dict()`}
    DIR/batches/{k:06d}-{rank}.pt
                                generation batch k, one process's share, as scoring left it and before the seeded
                                shuffle into micro-batches: a `torch.save`d dict of TRL's scored entries (prompt_ids,
                                prompt_mask, completion_ids, completion_mask, sampling_per_token_logps = the
                                behaviour log-probs, advantages, num_items_in_batch, ...), `behavior_version` (B, T:
                                each completion token's policy version) and `rewards_per_func` (the whole batch's
                                rewards, every process's, as TRL gathers them). The recompute anchor is the trained
                                method's, not the data's: not recorded.

Each batch is written when it is scored, atomically (a run resumed from a checkpoint writes again the batches it
trains again). `trl_a3po.replay` trains on a recording.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from .trainer import A3POTrainer

FORMAT = 1


def policy_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every parameter's name, dtype, shape and bytes, in name order: the same weights, or not."""
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
        tensor = parameter.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _batch_path(directory: str, index: int, rank: int) -> str:
    return os.path.join(directory, "batches", f"{index:06d}-{rank}.pt")


class BatchRecorder:
    """Writes a run's generation batches as it trains them (`A3POConfig.record_generation_batches`)."""

    def __init__(self, directory: str, trainer: A3POTrainer):
        self.directory = directory
        self.accelerator = trainer.accelerator
        self._rewards_per_func: torch.Tensor | None = None
        sharded = trainer._dist.is_zero3 or trainer._dist.is_fsdp
        if sharded:
            raise ValueError(
                "record_generation_batches: the manifest fingerprints the initial weights, which ZeRO-3 / FSDP shard "
                "across processes; record with DDP or one process, or set record_generation_batches=None."
            )

    def start(self, trainer: A3POTrainer, resuming: bool) -> None:
        """Write the manifest (main process), or on a resume check that the one there is this run's."""
        manifest = os.path.join(self.directory, "manifest.json")
        if resuming:
            if not os.path.exists(manifest):
                raise FileNotFoundError(
                    f"record_generation_batches={self.directory!r}: resuming, but {manifest} is missing (the "
                    "recording of the run being resumed); record into the folder the run started with."
                )
            return
        if self.accelerator.is_main_process:
            os.makedirs(os.path.join(self.directory, "batches"), exist_ok=True)
            content = {
                "format": FORMAT,
                "num_processes": self.accelerator.num_processes,
                "initial_weights": policy_fingerprint(self.accelerator.unwrap_model(trainer.model)),
                "reward_func_names": list(trainer.reward_func_names),
                "reward_weights": trainer.reward_weights.tolist(),
                "config": trainer.args.to_dict(),
            }
            _write_atomically(manifest, lambda path: _dump_json(content, path))
        self.accelerator.wait_for_everyone()

    def note_rewards(self, rewards_per_func: torch.Tensor) -> None:
        self._rewards_per_func = rewards_per_func.detach().cpu()

    def write(self, index: int, batch: dict) -> None:
        record = {
            key: value.detach().cpu() if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()
            if key != "prox_per_token_logps"
        }
        record["rewards_per_func"], self._rewards_per_func = self._rewards_per_func, None
        path = _batch_path(self.directory, index, self.accelerator.process_index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_atomically(path, lambda tmp: torch.save(record, tmp))


class Recording:
    """A recording's manifest, and its batches on demand."""

    def __init__(self, directory: str):
        self.directory = directory
        path = os.path.join(directory, "manifest.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path}: no recording here (a run writes one with A3POConfig(record_generation_batches=...))."
            )
        with open(path) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r}; this trl_a3po reads format {FORMAT}.")
        self.config = self.manifest["config"]

    def batch(self, index: int, rank: int) -> dict:
        path = _batch_path(self.directory, index, rank)
        if not os.path.exists(path):
            recorded = len(os.listdir(os.path.join(self.directory, "batches")))
            raise ValueError(
                f"{path}: generation batch {index} of process {rank} was not recorded ({recorded} batch files in "
                f"{self.directory}); replay at most as many training steps as the recorded run trained."
            )
        return torch.load(path, weights_only=True)


def _dump_json(content: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(content, f, indent=1, default=str)


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp"
    write(tmp)
    os.replace(tmp, path)
