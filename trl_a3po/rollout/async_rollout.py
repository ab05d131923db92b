"""The trainer side of asynchronous generation: one `AsyncRollout` per `A3POTrainer.train()` call, on every process.

Its lifetime, in `A3POTrainer.train`: built before TRL's training loop, started by its first `take` (the first batch
index is known only once a resumed checkpoint is loaded), closed when `train()` ends, however it ends. It owns the
queue (on the processes that run a producer), the staleness bound, the prompt plans, publishing, submission, the
hand-out of every process's share and the prompt check. It runs on the trainer's main thread only, so its fields need
no lock; the queue's threads are the producer side (`queue.py`, `continuous.py`).

Where a batch's versions come from: `take(k)` publishes version k (the live weights), submits every batch the bound
admits, and returns batch k as the producer generated it, each completion token tagged with the version that sampled
it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import broadcast_object_list

from .backend import BackendContext, Generation, backend_entry
from .continuous import ContinuousGenerationQueue
from .episodes import Episode, EpisodeRunner
from .errors import for_other_processes
from .policy_weights import policy_tensors
from .prompt_plan import PlanSource, generation_batches
from .queue import GenerationQueue, StalenessBound


@dataclass
class GeneratedShare:
    """One process's part of one generation batch, in the trainer's row order. While TRL scores it, each of the
    trainer's generation hooks takes what TRL expects of it from one method here."""

    index: int  # the generation batch
    prompt_ids: list[list[int]]
    generation: Generation  # per completion token: its id, behaviour log-prob and the version that sampled it
    stats: dict[str, float]  # queue metrics for this batch, under their logged names
    episodes: list[Episode] | None = None  # multi-turn rows (tools, environments): how each was played

    def check_prompts(self, prompt_ids: list[list[int]]) -> None:
        if self.prompt_ids != list(prompt_ids):
            raise RuntimeError(
                f"Generation batch {self.index}: the producer's prompts differ from the trainer's. The prompt order "
                "diverged from the training dataloader's (a custom sampler or data collator?), or an environment's "
                "`reset` observation was not the one played; set async_generation=False."
            )

    def generated_turn(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """TRL's `_generate_single_turn`: completion ids and log-probs (episodes: their first turn, which TRL parses
        before asking `_tool_call_loop` for the rest)."""
        self.check_prompts(prompt_ids)
        if self.episodes is not None:
            return [e.first_turn_ids for e in self.episodes], [e.first_turn_logprobs for e in self.episodes]
        return self.generation.ids, self.generation.logprobs

    def tool_loop_output(self) -> tuple:
        """TRL's `_tool_call_loop`: what the producer's run of that loop gave each episode (`episodes.py`)."""
        episodes = self.episodes
        return (
            [e.tool_mask for e in episodes],
            [e.completions for e in episodes],
            [e.completion_ids for e in episodes],
            [e.logprobs for e in episodes],
            sum(e.tool_calls for e in episodes),
            sum(e.tool_failures for e in episodes),
            [[] for _ in episodes],  # tool images: text-only
        )

    def rollout_func_output(self, prompts: list) -> dict:
        """TRL's `rollout_func` output: what the user's function returned in the producer, row by row."""
        episodes = self.episodes
        if [e.prompt for e in episodes] != list(prompts):
            self.check_prompts([])  # raises, naming the batch
        per_row = episodes[0].rollout_fields_per_row
        return {
            "prompt_ids": [e.prompt_ids for e in episodes],
            "completion_ids": [e.completion_ids for e in episodes],
            "logprobs": [e.logprobs for e in episodes],
            **{
                key: [e.rollout_fields[key] for e in episodes] if key in per_row else value
                for key, value in episodes[0].rollout_fields.items()
            },
        }

    def played_environments(self, names) -> dict:
        """TRL's environment pool while this share is scored: TRL's preamble draws each row's instance from its pool
        and calls `reset` on it; the producer played (and reset) the episodes on instances of its own already, so the
        pool's slots return what the producer's `reset` returned, and TRL rebuilds the very prompts that were played.
        The rewards then read the played instances (`A3POTrainer._calculate_rewards`)."""
        return {name: _PlayedSlots([e for e in self.episodes if e.environment_name == name]) for name in names}

    def behavior_version(self, width: int, device) -> torch.Tensor:
        """(rows, width): each completion token's version; padding takes its row's last version (masked everywhere,
        and never a negative staleness)."""
        return torch.tensor(
            [
                (row + [row[-1] if row else self.index] * (width - len(row)))[:width]
                for row in self.generation.versions
            ],
            dtype=torch.long,
            device=device,
        )


@dataclass(frozen=True)
class RolloutContext:
    """What the asynchronous side reads of the training setup, handed in once by the trainer
    (`A3POTrainer._start_rollout`): nothing here reaches into the trainer itself."""

    args: Any  # the A3POConfig
    accelerator: Any
    plan_source: PlanSource  # what the prompt plans read (`prompt_plan.py`)
    policy: Callable[[], Any]  # the live policy as Accelerate wraps it (wrapped once training starts: called then)
    dist: Any  # TRL's DistributedBackend: which sharding, and its gathers
    generation_config: Any  # TRL's sampling settings
    pad_token_id: int
    eos_token_ids: list[int]
    tokenize_prompts: Callable[[list], list[list[int]]]  # TRL's: dataset prompts (text or messages) -> token ids
    # Rows played as episodes (tools, environments, a rollout_func): builds the producer's `EpisodeRunner`
    episode_runner: Callable[[], EpisodeRunner] | None = None


class AsyncRollout:
    """Generation ahead of the trainer within its staleness bound; see the module's docstring."""

    def __init__(self, context: RolloutContext):
        self.context = context
        self.args = context.args
        self.accelerator = context.accelerator
        # All fields below: the trainer's main thread only.
        self.queue: GenerationQueue | None = None  # on the processes that run a producer (`runs_producer`)
        self.bound: StalenessBound | None = None  # on every process, once started
        self.plans = None  # per process served: iterator over its future generation batches, in sampler order
        self.submitted = 0  # generation batches handed to the producer so far
        self.sends_adapter = False  # the vLLM server gets the LoRA adapter alone (lora_weight_sync)
        self.plays_episodes = context.episode_runner is not None
        self.entry = backend_entry(self.args.rollout_backend)  # how to build the generator, what it can do
        self.last_take: float | None = None  # when the last `take` returned (perf_counter)

    @property
    def runs_producer(self) -> bool:
        """In-process generation (HF generate or a colocated vLLM engine): every process generates its own share on
        its own generator. A vLLM server: the main process alone generates every process's share and hands each its
        part, so the server's weights have one owner (one push per version, from one process) and no request is
        mid-generation during a push."""
        return not self.entry.serves_every_process or self.accelerator.is_main_process

    @property
    def serves_other_processes(self) -> bool:
        return self.entry.serves_every_process and self.accelerator.num_processes > 1

    # ------------------------------------------------------------------ lifetime

    def start(self, first_index: int) -> None:
        """Build the backend and the queue (on producer processes), start the producer, plan from `first_index` on."""
        context = self.context
        self.bound = StalenessBound(self.args.max_staleness)
        self.submitted = first_index
        if not self.runs_producer:
            return
        backend = self.entry.factory(
            BackendContext(
                args=self.args,
                model=self.accelerator.unwrap_model(context.policy()),
                generation_config=context.generation_config,
                pad_token_id=context.pad_token_id,
                eos_token_ids=list(context.eos_token_ids),
                device=self.accelerator.device,
            )
        )
        self.sends_adapter = getattr(backend, "sync_mode", "merged") == "adapter"
        served = (
            range(self.accelerator.num_processes)
            if self.entry.serves_every_process
            else [self.accelerator.process_index]
        )
        queue_class = ContinuousGenerationQueue if self.args.continuous_generation else GenerationQueue
        episodes = context.episode_runner() if self.plays_episodes else None
        self.queue = queue_class(
            backend,
            sync_every=self.args.weight_sync_steps,
            inflight_weight_updates=self.args.inflight_weight_updates,
            episodes=episodes,
            turn_weight_updates=self.args.turn_weight_updates,
        )
        self.queue.start()
        self.plans = [generation_batches(context.plan_source, first_index, p) for p in served]

    def close(self) -> None:
        queue, self.queue, self.plans = self.queue, None, None
        if queue is not None:
            queue.close()

    def raise_if_failed(self) -> None:
        if self.queue is not None:
            self.queue.raise_if_failed()

    # ------------------------------------------------------------------ one call per training step

    def take(self, index: int, version: int, last_index: int) -> GeneratedShare:
        """Batch `index`, this process's share, at the start of training step `index` (the live weights are version
        `version`; the run trains no batch past `last_index`: none is generated). Every process calls it at the same
        step: publishing sharded weights and handing out shares are collectives. Its prompts are checked against the
        trainer's when TRL asks for them (`generated_turn`)."""
        share = None
        try:
            if self.bound is None:
                self.start(index)
            # Every optimizer step of the previous training step has run (under DeepSpeed too, whose step happens
            # inside backward()), so the live weights are exactly version `index`. Publish them here, on the main
            # thread of every process (gathering sharded parameters is a collective), then hand the producer every
            # batch the staleness bound now allows.
            dist = self.context.dist
            if self.queue is not None or dist.is_zero3 or dist.is_fsdp:  # the gather needs every process
                with self._generator_tensors() as named_tensors:
                    if self.queue is not None:
                        self.queue.publish(version, named_tensors)
                    # (a process without a producer takes part in the gathers by draining them on leaving)
            start = time.perf_counter()
            if self.queue is not None:
                share = self._produce(index, version, last_index)
        except BaseException as error:
            if self.serves_other_processes and self.accelerator.is_main_process:
                # Tell the other processes before raising (a failed start, probe, publish or generation), or they
                # would wait for their share until the collective times out.
                broadcast_object_list([for_other_processes(error)])
            raise
        if self.serves_other_processes:
            shares = broadcast_object_list([share])[0]  # every process takes its own part
            if isinstance(shares, BaseException):
                raise shares
            if self.queue is not None:  # the other processes score copies of their environments (pickled)
                for other in shares[: self.accelerator.process_index] + shares[self.accelerator.process_index + 1 :]:
                    self.release_environments(other)
            share = shares[self.accelerator.process_index]
        now = time.perf_counter()
        share.stats["a3po/queue/trainer_wait_s"] = now - start
        if self.last_take is not None:  # the share of the last training step's wall the trainer spent waiting
            share.stats["trainer/idle_ratio"] = (now - start) / max(now - self.last_take, 1e-9)
        self.last_take = now
        return share

    def _produce(self, index: int, version: int, last_index: int):
        """On a producer process: submit what the bound allows, take batch `index`, and cut it into one share per
        served process; the list of them when serving every process, else this process's share."""
        # Nothing past the last batch the run will train: generating it would only cost the generator time.
        while self.submitted <= min(self.bound.last_submittable(version), last_index):
            planned = [next(plan) for plan in self.plans]  # (index, rows) per served process
            planned_index = planned[0][0]
            min_version = self.bound.min_version(planned_index)
            if self.plays_episodes:  # prompts exist once played (an environment's reset extends them)
                self.queue.submit(planned_index, None, min_version, rows=[row for _, rows in planned for row in rows])
            else:
                prompt_ids = [
                    ids for _, rows in planned for ids in self.context.tokenize_prompts([r["prompt"] for r in rows])
                ]
                self.queue.submit(planned_index, prompt_ids, min_version)
            self.submitted = planned_index + 1
        result = self.queue.get(index)
        batch = result.batch
        stats = {
            **self._episode_stats(batch.episodes),
            "a3po/queue/producer_idle_s": result.idle_s,
            # the generator's idle share over this batch (waiting for the staleness bound), as verl names it
            "rollouter/idle_ratio": result.idle_s
            / max(result.idle_s + batch.generation_s + batch.weight_sync_s, 1e-9),
            "a3po/queue/depth": self.queue.depth,
            "a3po/gen/tokens_per_s": batch.generation.num_tokens / max(batch.generation_s, 1e-9),
            "a3po/gen/weight_sync_s": batch.weight_sync_s,
        }
        size = len(result.prompt_ids) // len(self.plans)  # every process's share has the same size
        shares = [
            GeneratedShare(
                index,
                result.prompt_ids[i : i + size],
                batch.generation[i : i + size],
                dict(stats),
                None if batch.episodes is None else batch.episodes[i : i + size],
            )
            for i in range(0, len(result.prompt_ids), size)
        ]
        return shares if self.serves_other_processes else shares[0]

    @staticmethod
    def _episode_stats(episodes: list[Episode] | None) -> dict[str, float]:
        if episodes is None:
            return {}
        return {
            "a3po/tools/wait_s": sum(e.tool_s for e in episodes) / len(episodes),  # per episode, mean
            "a3po/episodes/versions_per_episode": sum(len(set(e.versions)) for e in episodes) / len(episodes),
        }

    def release_environments(self, share: GeneratedShare) -> None:
        """Once `share` is scored: its episodes' environment instances go back to the producer's pool (a process
        without a producer scored copies of them: nothing to give back)."""
        if self.queue is None:
            return
        for episode in share.episodes or []:
            if episode.environment is not None:
                self.queue.release_environment(episode.environment_name, episode.environment)

    @contextlib.contextmanager
    def _generator_tensors(self):
        """What the generator loads for a version, as (name, tensor) pairs: the LoRA adapter's own tensors (PEFT's
        saved form) when it is sent to the server as an adapter, else the whole merged weights."""
        if self.sends_adapter:
            from peft import get_peft_model_state_dict

            yield iter(get_peft_model_state_dict(self.accelerator.unwrap_model(self.context.policy())).items())
        else:
            with policy_tensors(self.context.policy(), self.context.dist) as named_tensors:
                yield named_tensors


class _PlayedSlots:
    """TRL's environment pool for one name while a share is scored (`GeneratedShare.played_environments`): TRL hands
    the `j`-th row of that environment slot `j` (it creates an instance only when its cursor reaches the pool's
    length: never)."""

    def __init__(self, episodes: list[Episode]):
        self._episodes = episodes  # the share's episodes of this environment, in row order

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, position: int) -> _PlayedEnvironment:
        return _PlayedEnvironment(self._episodes[position].observation)


class _PlayedEnvironment:
    """Stands for a played episode's environment in TRL's preamble: its `reset` is the one the producer already made,
    returning the observation recorded then."""

    def __init__(self, observation):
        self._observation = observation

    def reset(self, **kwargs):
        return self._observation
