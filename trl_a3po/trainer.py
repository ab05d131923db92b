"""A3POTrainer: GRPOTrainer with behaviour log-probs, policy versions and the decoupled A-3PO loss.

The glue only: the math lives in `proximal.py`, generation in `rollout/`. Hooks overridden, and why:
- `_generate_single_turn`: TRL's HF-generate path returns no log-probs; ours returns the behaviour log-probs. In
  asynchronous mode it hands over the producer's pre-generated batch instead of generating.
- `_generate_and_score_completions`: tag each sample with `behavior_version`, check its behaviour log-probs, and
  (recompute / metrics) run the one proximal forward per generation batch. TRL's scoring (rewards, advantages,
  gathers) runs unchanged, on the main thread.
- `_prepare_inputs` (asynchronous mode only): the same split into micro-batches, with a seeded shuffle.
- `_compute_loss`: the decoupled loss; with `use_decoupled_loss=False` it is GRPOTrainer's, untouched.
- `train`: stops the producer however training ends.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time

import torch
from accelerate.data_loader import BatchSamplerShard
from accelerate.utils import is_peft_model
from torch.utils.data import BatchSampler
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
from trl.trainer.utils import nanmax, nanmin, split_tensor_dict

from .config import A3POConfig
from .proximal import PROX_APPROXIMATIONS, aggregate_loss, approximate_prox_logp, decoupled_ppo_loss, staleness_alpha
from .rollout import (
    GenerationQueue,
    InProcessBackend,
    PolicyWeights,
    StalenessSchedule,
    generate_with_behavior_logprobs,
)


class _AsyncGenerationCallback(TrainerCallback):
    """Brackets every optimizer step so the producer never reads half-updated weights, then publishes the version;
    on resume, realigns GRPOTrainer's micro-step counter with the restored global step."""

    def __init__(self, trainer: A3POTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # GRPOTrainer's `_step` (micro-batches seen) restarts at 0 on resume; the generation batch index and the
        # slice of it to train both derive from it, so continue from where the checkpoint stopped.
        self.trainer._step = state.global_step * self.trainer._accumulation_steps

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._policy_weights is not None:
            self.trainer._policy_weights.begin_update()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._policy_weights is not None:
            # global_step is incremented right after this callback: the new weights are version global_step + 1.
            self.trainer._policy_weights.end_update(state.global_step + 1)


class A3POTrainer(GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that trains with A-3PO's decoupled loss (see `A3POConfig`)."""

    _tag_names = ["trl", "grpo", "a3po"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, A3POConfig):
            raise TypeError(f"A3POTrainer needs an A3POConfig as `args`, got {type(self.args).__name__}.")
        # Seconds spent obtaining proximal log-probs since the last optimizer step (the paper's Figure 1 metric).
        self._prox_seconds = 0.0
        self._train_start = time.perf_counter()
        # Read once: during TRL's scoring `self.args` is a view with an aligned gradient_accumulation_steps (see
        # `_without_trls_old_logp_forward`), and the producer's schedule must use the real one.
        self._accumulation_steps = self.args.gradient_accumulation_steps
        # Asynchronous generation: built at the first training batch, closed when training ends.
        self._queue: GenerationQueue | None = None
        self._policy_weights: PolicyWeights | None = None
        self._prompt_plan = None  # iterator over this process's future generation batches, in the sampler's order
        self._submitted = 0  # generation batches handed to the producer so far
        self._schedule: StalenessSchedule | None = None
        self._taken_versions: list[int] | None = None  # behaviour versions of the batch being scored
        if self.args.async_generation:
            if self.tools or self.environment_factories is not None or self.rollout_func is not None:
                raise ValueError(
                    "async_generation=True supports single-turn text prompts; tools, environment_factory and "
                    "rollout_func need async_generation=False."
                )
            zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
            if zero3 or self.is_fsdp_enabled:
                raise ValueError(
                    "async_generation=True needs whole (unsharded) parameters to hand to the generator; with FSDP or "
                    "DeepSpeed ZeRO-3 set async_generation=False, or train with DDP / ZeRO-2."
                )
            if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
                raise ValueError(
                    "async_generation=True needs a map-style train_dataset (the producer follows the sampler's "
                    "order ahead of the trainer); convert it, or set async_generation=False."
                )
            self.add_callback(_AsyncGenerationCallback(self))

    # ------------------------------------------------------------------ asynchronous generation

    def train(self, *args, **kwargs):
        self._train_start = time.perf_counter()  # for a3po/wall_time_s: reward vs wall-clock plots
        try:
            return super().train(*args, **kwargs)
        finally:
            self._close_queue()

    def _close_queue(self) -> None:
        if self._queue is not None:
            self._queue.close()
        self._queue = self._policy_weights = self._prompt_plan = None

    @property
    def _micro_steps_per_generation(self) -> int:
        return self.args.steps_per_generation * self.num_iterations

    def _generation_batches(self, start: int):
        """This process's generation batches (dataset rows) in the synchronous trainer's order, from `start` on.

        The same sampler, seed and Accelerate sharding as the training dataloader (which yields each generation batch
        R = steps_per_generation * num_iterations times in a row); the trainer checks every batch against it.
        """
        sampler = self._get_train_sampler()
        per_process = self._train_batch_size * self.args.steps_per_generation
        batches = BatchSamplerShard(
            BatchSampler(sampler, per_process, drop_last=self.args.dataloader_drop_last),
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            split_batches=False,
            even_batches=self.accelerator.even_batches,
        )
        per_epoch = len(batches) // self._micro_steps_per_generation
        if per_epoch == 0:
            raise ValueError("the train dataset is smaller than one generation batch")
        # Like the Trainer on resume: a fresh sampler, skipping the batches already consumed in the current epoch.
        skip = start % per_epoch
        index = start
        for _epoch in itertools.count():
            for position, indices in enumerate(batches):
                if position % self._micro_steps_per_generation:
                    continue  # a repeat of the generation batch just yielded
                if skip:
                    skip -= 1
                    continue
                yield index, [self.train_dataset[i] for i in indices]
                index += 1

    def _start_queue(self, start: int) -> None:
        model = self.accelerator.unwrap_model(self.model)
        self._policy_weights = PolicyWeights(self._policy_tensors, version=self.state.global_step)
        if self.args.rollout_backend == "inprocess":
            base = model.get_base_model() if is_peft_model(model) else model
            snapshot = AutoModelForCausalLM.from_config(base.config, dtype=next(base.parameters()).dtype)
            snapshot.to(self.accelerator.device)
            backend = InProcessBackend(
                snapshot,
                self._policy_weights,
                self.generation_config,
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_ids=list(self.eos_token_ids),
            )
        else:
            from .rollout.vllm_server import VLLMServerBackend

            backend = VLLMServerBackend.from_config(self.args, self._policy_weights, list(self.eos_token_ids))
        self._queue = GenerationQueue(backend, self._policy_weights)
        self._schedule = StalenessSchedule(
            self._micro_steps_per_generation, self._accumulation_steps, self.args.max_staleness
        )
        self._prompt_plan = self._generation_batches(start)
        self._submitted = start

    def _policy_tensors(self) -> dict[str, torch.Tensor]:
        """The policy's weights under plain HF names; LoRA adapters merged (W + scale * B @ A) without touching the
        live model. Called by the producer while the optimizer is held off."""
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            return model.state_dict()  # parameters and persistent buffers, sharing the live storage (no copy)
        from peft.tuners.lora import LoraLayer

        base = model.get_base_model()
        tensors = {}
        for name, tensor in base.state_dict().items():
            if "lora_" in name or ".original_module." in name:
                continue
            tensors[name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = tensor
        for module_name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                key = f"{module_name}.weight"
                delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
                tensors[key] = tensors[key] + delta.to(tensors[key].dtype)
        return tensors

    def _prepare_inputs(self, generation_batch):
        if not (self.args.async_generation and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # GRPOTrainer's own version shuffles each generation batch with the global RNG before cutting it into
        # micro-batches; the producer thread samples from that same global RNG, so the cut would depend on thread
        # timing. Here the shuffle is seeded by the batch index: the cut is reproducible, and a resume inside a batch
        # trains exactly the micro-batches the checkpoint had not trained.
        generate_every = self._micro_steps_per_generation
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self._step // generate_every)
            permutation = torch.randperm(len(batch["prompt_ids"]), generator=generator)
            batch = {key: _take_rows(value, permutation) for key, value in batch.items()}
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _take_generated_batch(self, prompt_ids: list[list[int]]):
        index = self._step // self._micro_steps_per_generation
        if self._queue is None:
            self._start_queue(index)
        # Hand the producer every batch it could generate before this one is fully trained (the bound decides).
        while self._submitted <= self._schedule.submit_until(index):
            planned_index, rows = next(self._prompt_plan)
            planned_ids, _, _ = self._tokenize_prompts([row["prompt"] for row in rows])
            self._queue.submit(planned_index, planned_ids, self._schedule.min_version(planned_index))
            self._submitted = planned_index + 1

        start = time.perf_counter()
        result = self._queue.get(index)
        waited = time.perf_counter() - start
        if result.prompt_ids != list(prompt_ids):
            raise RuntimeError(
                f"Generation batch {index}: the producer's prompts differ from the trainer's. The prompt order "
                "diverged from the training dataloader's (a custom sampler or data collator?); set "
                "async_generation=False."
            )
        batch = result.batch
        self._taken_versions = batch.versions
        metrics = self._metrics["train"]
        num_tokens = sum(len(ids) for ids in batch.completion_ids)
        metrics["a3po/queue/trainer_wait_s"].append(waited)
        metrics["a3po/queue/producer_bound_wait_s"].append(result.bound_wait_s)
        metrics["a3po/queue/depth"].append(self._queue.depth)
        metrics["a3po/gen/tokens_per_s"].append(num_tokens / max(batch.generation_s, 1e-9))
        metrics["a3po/gen/weight_sync_s"].append(batch.weight_sync_s)
        return batch.completion_ids, batch.logprobs

    # ------------------------------------------------------------------ generation side

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.args.async_generation and self.model.training:
            return self._take_generated_batch(prompt_ids)
        if self.use_vllm or not self.args.use_decoupled_loss:
            # vLLM already returns the sampled tokens' log-probs (TRL asks for processed_logprobs).
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        if images is not None or multimodal_fields:
            raise NotImplementedError(
                "A3POTrainer's in-process generation is text-only; train multimodal models with use_vllm=True."
            )
        with (
            profiling_context(self, "transformers.generate"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            return generate_with_behavior_logprobs(
                unwrapped_model,
                prompt_ids,
                self.generation_config,
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_ids=list(self.eos_token_ids),
            )

    @contextlib.contextmanager
    def _without_trls_old_logp_forward(self):
        # When optimizer steps and generation batches are misaligned (gradient_accumulation_steps not a multiple of
        # steps_per_generation * num_iterations), GRPOTrainer runs a no-grad forward for its "old" log-probs. The
        # decoupled loss never reads them (behaviour + proximal log-probs replace them), and that forward is exactly
        # the cost A-3PO removes, so TRL is shown an aligned view of the arguments for the duration of the call.
        args = self.args
        aligned = copy.copy(args)
        aligned.gradient_accumulation_steps = args.steps_per_generation * self.num_iterations
        self.args = aligned
        try:
            yield
        finally:
            self.args = args

    def _generate_and_score_completions(self, inputs):
        if not self.args.use_decoupled_loss:
            return super()._generate_and_score_completions(inputs)
        self._taken_versions = None
        with self._without_trls_old_logp_forward():
            output = super()._generate_and_score_completions(inputs)
        behav = output.get("sampling_per_token_logps")
        if behav is None:
            raise RuntimeError(
                "The generation backend returned no behaviour log-probs, which the decoupled loss needs. A custom "
                "rollout_func must return per-token `logprobs`."
            )
        mask = output["completion_mask"].bool()
        bad = ~torch.isfinite(behav) & mask
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            prompt = inputs[row].get("prompt") if row < len(inputs) else None
            raise ValueError(
                f"Non-finite behaviour log-prob ({behav[row, col].item()}) for sample {row} of the generation batch, "
                f"completion token {col} (prompt: {str(prompt)[:200]!r}). The generator returned an invalid "
                "log-prob; check its dtype (fp16 overflow) and its logprobs mode (processed_logprobs)."
            )
        if self._taken_versions is not None:  # generated ahead by the producer
            behavior_version = torch.tensor(self._taken_versions, dtype=torch.long, device=behav.device)
        else:  # generated just now, by the current weights
            behavior_version = torch.full((behav.size(0),), self.state.global_step, dtype=torch.long,
                                          device=behav.device)
        output["behavior_version"] = behavior_version
        if self.model.training and self.args.prox_logp_method in ("recompute", "metrics"):
            output["prox_per_token_logps"] = self._recompute_prox_logps(output)
        return output

    def _recompute_prox_logps(self, batch) -> torch.Tensor:
        """Decoupled PPO's proximal log-probs: one no-grad forward of the current policy over the whole batch."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        start = self._clock()
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            prox_logp, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                batch["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        self._prox_seconds += self._clock() - start
        return prox_logp

    def _clock(self) -> float:
        # Kernels run asynchronously on accelerators: synchronise so the time measured is the work's.
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------ loss side

    def _compute_loss(self, model, inputs):
        if self._queue is not None:
            self._queue.raise_if_failed()  # a producer failure surfaces within one step, with its traceback
        if not self.args.use_decoupled_loss:
            loss = super()._compute_loss(model, inputs)
            if self.model.training and self.accelerator.sync_gradients:
                # the same clock as the decoupled branch, so sync runs draw in the reward vs wall-clock figure
                self._metrics["train"]["a3po/wall_time_s"].append(time.perf_counter() - self._train_start)
            return loss
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )
        behav_logp = inputs["sampling_per_token_logps"]
        # Evaluation batches are generated by the current weights: staleness 0.
        staleness = (
            self.state.global_step - inputs["behavior_version"]
            if mode == "train"
            else torch.zeros_like(inputs["behavior_version"])
        )

        start = self._clock()
        if "prox_per_token_logps" in inputs:
            prox_logp = inputs["prox_per_token_logps"]
        else:
            prox_logp = approximate_prox_logp("loglinear", behav_logp, logp, staleness)
        self._prox_seconds += self._clock() - start

        per_token_loss, stats = decoupled_ppo_loss(
            logp,
            prox_logp,
            behav_logp,
            inputs["advantages"],
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            behav_imp_weight_cap=self.args.behav_imp_weight_cap,
            dual_clip_c=self.args.dual_clip_c,
        )
        if self.beta != 0.0:
            ref_logp = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
            if self.args.use_bias_correction_kl:
                # The samples come from the behaviour policy: pi_theta / pi_behav makes the KL estimate unbiased.
                per_token_kl = per_token_kl * torch.exp(logp - behav_logp)
            per_token_loss = per_token_loss + self.beta * per_token_kl

        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "dapo":
            # `num_items_in_batch` counts the generation batch's tokens on all processes: rescale to this process's
            # share of one accumulation window, as GRPOTrainer does.
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
            loss = aggregate_loss(per_token_loss, mask, "dapo", num_items=num_items)
        else:
            loss = aggregate_loss(per_token_loss, mask, self.loss_type, self.max_completion_length) / accumulation
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather(aux_loss.detach()).mean().item())

        self._log_loss_metrics(mode, stats, staleness, mask, entropies, logp, behav_logp, prox_logp, inputs)
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(self._global_masked_mean(per_token_kl.detach(), mask))
        return loss

    # ------------------------------------------------------------------ metrics

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        mask = mask.to(values.dtype)
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_loss_metrics(self, mode, stats, staleness, mask, entropies, logp, behav_logp, prox_logp, inputs):
        metrics = self._metrics[mode]
        reduce = self.accelerator.reduce
        sums = reduce(
            torch.stack(
                [
                    stats["num_tokens"],
                    stats["behav_imp_weight_sum"],
                    stats["behav_imp_weight_count"],
                    stats["capped_sum"],
                    stats["clip_low_sum"],
                    stats["clip_high_sum"],
                    stats["dual_clip_sum"],
                ]
            ),
            reduction="sum",
        ).tolist()
        tokens, weight_sum, weight_count, capped, clip_low, clip_high, dual = sums
        tokens = max(tokens, 1.0)
        extremes = self.accelerator.gather(
            torch.stack([stats["behav_imp_weight_min"], stats["ratio_min"]]).unsqueeze(0)
        )
        maxima = self.accelerator.gather(torch.stack([stats["behav_imp_weight_max"], stats["ratio_max"]]).unsqueeze(0))
        all_staleness = self.accelerator.gather(staleness)
        alpha = staleness_alpha(all_staleness)

        metrics["a3po/staleness/mean"].append(all_staleness.float().mean().item())
        metrics["a3po/staleness/max"].append(all_staleness.max().item())
        if mode == "train":
            # Histogram inputs: the share of samples at each staleness 0..max_staleness (fixed keys, every step).
            eta = self.args.max_staleness
            counts = torch.bincount(all_staleness.clamp(min=0, max=eta), minlength=eta + 1)
            for d, share in enumerate((counts.float() / all_staleness.numel()).tolist()):
                metrics[f"a3po/staleness/frac_d{d}"].append(share)
        metrics["a3po/alpha/mean"].append(alpha.mean().item())
        metrics["a3po/behav_imp_weight/mean"].append(weight_sum / max(weight_count, 1.0))
        metrics["a3po/behav_imp_weight/min"].append(nanmin(extremes[:, 0]).item())
        metrics["a3po/behav_imp_weight/max"].append(nanmax(maxima[:, 0]).item())
        metrics["a3po/capped_frac"].append(capped / tokens)
        metrics["a3po/ratio/min"].append(nanmin(extremes[:, 1]).item())
        metrics["a3po/ratio/max"].append(nanmax(maxima[:, 1]).item())
        metrics["a3po/dual_clip_frac"].append(dual / tokens)
        # GRPOTrainer's names, so TRL dashboards and the paper's "clipped tokens" figure read them unchanged.
        metrics["clip_ratio/low_mean"].append(clip_low / tokens)
        metrics["clip_ratio/high_mean"].append(clip_high / tokens)
        metrics["clip_ratio/region_mean"].append((clip_low + clip_high) / tokens)
        metrics["entropy"].append(self._global_masked_mean(entropies.detach(), mask))

        if mode == "train" and self.args.prox_logp_method == "metrics":
            self._log_prox_approximation_errors(metrics, staleness, mask, logp, behav_logp, prox_logp)
        if mode == "train" and self.accelerator.sync_gradients:
            # One value per optimizer step, averaged over processes.
            seconds = reduce(torch.tensor(self._prox_seconds, device=self.accelerator.device), reduction="mean")
            metrics["a3po/prox_time_s"].append(seconds.item())
            self._prox_seconds = 0.0
            metrics["a3po/wall_time_s"].append(time.perf_counter() - self._train_start)

    def _log_prox_approximation_errors(self, metrics, staleness, mask, logp, behav_logp, prox_logp):
        """Error of each approximation against the recomputed proximal log-probs, overall and per staleness."""
        mask = mask.to(prox_logp.dtype)
        all_staleness = self.accelerator.gather(staleness)
        for method in PROX_APPROXIMATIONS:
            approx = approximate_prox_logp(method, behav_logp, logp, staleness)
            abs_err = (approx - prox_logp).abs() * mask
            rel_err = abs_err / prox_logp.abs().clamp(min=1e-8)
            # Per sample (sum, count) gathered from every process: the per-staleness buckets are then computed
            # identically everywhere, so no process waits on a collective the others skip.
            per_sample = self.accelerator.gather(
                torch.stack([abs_err.sum(-1), rel_err.sum(-1), mask.sum(-1)], dim=-1).float()
            )
            total = per_sample.sum(0)
            count = total[2].clamp(min=1.0)
            metrics[f"a3po/prox_error/{method}/abs"].append((total[0] / count).item())
            metrics[f"a3po/prox_error/{method}/rel"].append((total[1] / count).item())
            for d in all_staleness.unique().tolist():
                bucket = per_sample[all_staleness == d].sum(0)
                metrics[f"a3po/prox_error/{method}/abs/d{d}"].append((bucket[0] / bucket[2].clamp(min=1.0)).item())


def _take_rows(value, rows: torch.Tensor):
    """Reorder one per-sample entry of a generation batch (tensors with a batch dim, or lists); keep scalars."""
    if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return value
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    return [value[i] for i in rows.tolist()]
