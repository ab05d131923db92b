"""Generation with HF `generate` that also returns the behaviour policy's log-prob of every sampled token."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    GenerationConfig,
    LogitsProcessor,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from trl.trainer.utils import pad

from .backend import RolloutBackend
from .staging import NamedTensors, StagedWeights, as_pairs, stage_copy, wait_until_staged


logger = logging.getLogger(__name__)


def left_pad(prompt_ids: list[list[int]], pad_token_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask` (TRL's `pad`): generation continues from each row's last column.
    At least `width` columns."""
    rows = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
    input_ids = pad(rows, padding_value=pad_token_id, padding_side="left")
    attention_mask = pad([torch.ones_like(row) for row in rows], padding_value=0, padding_side="left")
    extra = width - input_ids.size(1)
    if extra > 0:
        input_ids = F.pad(input_ids, (extra, 0), value=pad_token_id)
        attention_mask = F.pad(attention_mask, (extra, 0), value=0)
    return input_ids, attention_mask


# The compiled decoder's prompt widths are rounded up to a multiple of this, so that a run sees a handful of shapes.
COMPILED_WIDTH_STEP = 64


def grouped_decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, except in a decoding step (one query token) of a grouped-query model: there the
    query heads that share a key/value head become that head's query rows, so the step reads the KV cache once.

    transformers does the same outside torch.compile (`pack_gqa`, newer releases only); under compile, which is where
    the static cache decodes, it repeats every key/value head for each of its query heads (`repeat_kv`), writing and
    reading the whole cache again (6 times over for Qwen2.5-1.5B's 12 query / 2 key-value heads) in every layer of
    every step, the bulk of a step at batch 64 (DESIGN.md, "The in-process decoder"). The mask is per row and
    position, the same for every head, so it broadcasts over the query rows as it did over the heads.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, head_dim = query.shape
    mask_per_head = attention_mask is not None and attention_mask.shape[1] != 1
    if q_length != 1 or groups == 1 or mask_per_head or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = F.scaled_dot_product_attention(
        query.reshape(batch, heads // groups, groups, head_dim),
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
    )
    return output.reshape(batch, 1, heads, value.shape[-1]), None


# The snapshot's attention when it decodes with the static cache and its model attends with "sdpa" (masks: SDPA's).
GROUPED_DECODE_SDPA = "a3po_grouped_decode_sdpa"
AttentionInterface.register(GROUPED_DECODE_SDPA, grouped_decode_sdpa)
AttentionMaskInterface.register(GROUPED_DECODE_SDPA, sdpa_mask)


def build_whole_snapshot(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """A plain, whole copy of `model`'s architecture on `device`, for the generator (its weights arrive by `load`).

    Built by calling the model class directly, not `from_config`: under DeepSpeed ZeRO-3 `from_config` builds inside
    `deepspeed.zero.Init`, which would partition the snapshot across the training processes (its parameters empty
    outside a gather). The dtype comes from the model, not from a parameter (under FSDP or ZeRO-3 those may be flat
    shards).
    """
    with torch.device(device):
        snapshot = type(model)(copy.deepcopy(model.config))
    return snapshot.to(model.dtype)


def generate_with_behavior_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    generation_config: GenerationConfig,
    pad_token_id: int,
    eos_token_ids: list[int],
    stop: threading.Event | None = None,
    synced_gpus: bool | None = None,
    interrupt: Callable[[], bool] | None = None,
    budgets: list[int] | None = None,
    compiled: bool = False,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt; return the completion ids (up to and including the first EOS) and, for
    each sampled token, its log-prob under the distribution it was sampled from.

    That distribution is `generate`'s processed scores (temperature, top-k, top-p and every other processor
    applied), i.e. exactly the behaviour policy. TRL's own HF-generate path returns no log-probs, hence this
    function. Only the sampled token's log-prob of each step is kept (batch x tokens floats, see `_SampledLogprobs`),
    never the scores of every step (`output_scores`: batch x tokens x vocabulary). Once `stop` is set, generation
    ends at the next token (the caller discards the incomplete result). `synced_gpus` is `generate`'s (None: its
    default, True under ZeRO-3 / FSDP with several processes, where every process must step together); a private
    snapshot passes False, since it is whole and must never enter a collective. Once `interrupt()` returns True (asked
    after every token), generation ends there (a newer version is due: the caller continues the unfinished rows).
    `budgets`: row r samples at most `budgets[r]` tokens (default: `max_new_tokens` for every row).

    `compiled`: decode with a static KV cache, which on CUDA makes `generate` compile its decoding step (torch.compile,
    CUDA graphs; transformers' `_valid_auto_compile_criteria`). The shapes are kept few so that compilation is paid
    once per run, not per batch: the prompt width is left-padded up to a multiple of `COMPILED_WIDTH_STEP` and every
    call runs to the config's `max_new_tokens` (the per-row budgets end rows early; all rows done ends the call).
    """
    device = model.device
    if budgets is None:
        budgets = [generation_config.max_new_tokens] * len(prompt_ids)
    generation_config = copy.deepcopy(generation_config)
    # GRPOTrainer turns `use_cache` off in the policy's config (training has no use for it); without the KV cache,
    # every new token would recompute the whole sequence.
    generation_config.use_cache = True
    generation_config.output_scores = False
    generation_config.return_dict_in_generate = False
    width = max(map(len, prompt_ids))
    if compiled:
        generation_config.cache_implementation = "static"
        generation_config.disable_compile = False
        width = -(-width // COMPILED_WIDTH_STEP) * COMPILED_WIDTH_STEP
    else:
        generation_config.max_new_tokens = max(budgets)
    input_ids, attention_mask = left_pad(prompt_ids, pad_token_id, width)
    capture = _SampledLogprobs(len(prompt_ids), generation_config.max_new_tokens, width, device)
    stopping = _StopWhen(stop, interrupt, width, budgets, eos_token_ids, capture)
    with capture.appended_to(model):
        sequences = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=generation_config,
            stopping_criteria=StoppingCriteriaList([stopping]),
            synced_gpus=synced_gpus,
        )
    if not isinstance(sequences, torch.Tensor):  # a `generate` that returns a dict whatever the config says
        sequences = sequences.sequences
    completion = sequences[:, width:]
    num_steps = completion.size(1)
    if capture.steps >= num_steps:
        token_logprobs = capture.logprobs[:, :num_steps]
    else:  # a `generate` that bypassed transformers' logits processors (custom decoding loops)
        token_logprobs = _rescore(model, sequences, attention_mask.to(device), generation_config)
    token_logprobs, completion = token_logprobs.cpu(), completion.cpu()

    eos = torch.tensor(eos_token_ids, dtype=torch.long)
    completion_ids, logprobs = [], []
    for row in range(completion.size(0)):
        is_eos = torch.isin(completion[row], eos).nonzero()
        length = min(int(is_eos[0]) + 1 if len(is_eos) else num_steps, budgets[row])
        completion_ids.append(completion[row, :length].tolist())
        logprobs.append(token_logprobs[row, :length].tolist())
    return completion_ids, logprobs


class _SampledLogprobs(LogitsProcessor):
    """Each step's sampled-token log-prob under the processed distribution, with memory batch x tokens.

    Appended as the last logits processor of `generate`'s own chain (after temperature, top-k, top-p, min-p,
    repetition penalty and every other processor transformers builds from the config), it holds the processed scores
    of the current step; `generate` samples from exactly these (softmax, then multinomial or argmax) and then asks its
    stopping criteria, where `_StopWhen` calls `record` with the sampled token appended. Custom processors passed to
    `generate` are placed before the sampling warpers, so the chain's end can only be reached through
    `_get_logits_processor`, which `appended_to` wraps on the (private) model for the duration of one call.
    """

    def __init__(self, batch: int, max_steps: int, prompt_width: int, device: torch.device):
        self.logprobs = torch.zeros(batch, max_steps, dtype=torch.float32, device=device)
        self.prompt_width, self.steps, self._scores = prompt_width, 0, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._scores = scores
        return scores

    def record(self, input_ids: torch.LongTensor) -> None:
        step = input_ids.size(1) - self.prompt_width - 1
        if self._scores is None or step >= self.logprobs.size(1):  # no processed step (a custom decoding loop)
            return
        sampled = input_ids[:, -1:]
        self.logprobs[:, step] = torch.log_softmax(self._scores.float(), dim=-1).gather(-1, sampled).squeeze(-1)
        self.steps, self._scores = step + 1, None

    @contextlib.contextmanager
    def appended_to(self, model: PreTrainedModel):
        # A PEFT model's `generate` runs its base model's: the chain is built there.
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        build = model._get_logits_processor

        def with_capture(*args, **kwargs):
            processors = build(*args, **kwargs)
            processors.append(self)
            return processors

        own = model.__dict__.get("_get_logits_processor")
        model._get_logits_processor = with_capture
        try:
            yield
        finally:
            if own is None:
                del model._get_logits_processor  # the class's method again
            else:
                model._get_logits_processor = own


def _rescore(
    model: PreTrainedModel, sequences: torch.Tensor, prompt_mask: torch.Tensor, generation_config: GenerationConfig
) -> torch.Tensor:
    """Each completion token's log-prob under the processed scores `generate` sampled it from, for a `generate` that
    decodes outside transformers' processor chain: one forward of the same weights over the sequences (positions as
    `generate` counts them past the left padding), then the logits processors `generate` itself builds from this
    config (transformers' own `_get_logits_processor`), one step at a time. The forward's logits are the one
    batch x tokens x vocabulary tensor of this path (reached only by custom decoding loops)."""
    width = prompt_mask.size(1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, width:])], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, width - 1 : -1]
    model._prepare_special_tokens(generation_config, kwargs_has_attention_mask=True, device=sequences.device)
    processors = model._get_logits_processor(generation_config, input_ids_seq_length=width, device=sequences.device)
    steps = []
    for t in range(logits.size(1)):
        scores = processors(sequences[:, : width + t], logits[:, t].float())
        steps.append(torch.log_softmax(scores, dim=-1).gather(-1, sequences[:, width + t, None]).squeeze(-1))
    return torch.stack(steps, dim=1) if steps else logits.new_zeros(sequences.size(0), 0)


class InProcessBackend(RolloutBackend):
    """Generates on a private snapshot of the policy, in the producer thread (CPU, or the trainer's one GPU).

    The snapshot is a plain model built from the policy's config (never a deep copy of the trainer's model, whose
    forward TRL patches). `stage` (trainer's main thread) copies a published version's weights to the snapshot's
    device; `load` (producer thread, between generations) copies them into the snapshot. LoRA policies arrive
    already merged (the trainer merges), so generation runs at full-model speed.

    On a GPU the producer thread works on the snapshot's device and on a CUDA stream of its own, so generation
    kernels overlap the trainer's (which run on the default stream) instead of queueing behind them; `load` waits for
    the staging copy's event. What cannot overlap: the two threads share the GIL, so kernel launches interleave, and
    staging (a device-to-device copy on the trainer's stream) takes the trainer's time.
    """

    serves_concurrent_requests = False  # one `generate` at a time: continuous generation merges batches into one

    def __init__(
        self,
        snapshot: PreTrainedModel,
        generation_config: GenerationConfig,
        pad_token_id: int,
        eos_token_ids: list[int],
        compiled: bool = False,
    ):
        self.snapshot = snapshot.eval().requires_grad_(False)
        self.generation_config = generation_config
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        # Decode with the static cache and compiled steps (see `generate_with_behavior_logprobs`). Until one such call
        # has succeeded, a failure (a model that cannot compile) switches to HF generate as configured, said once.
        self.compiled, self._compiled_ok = compiled, False
        if compiled and self.snapshot.config._attn_implementation == "sdpa":
            self.snapshot.set_attn_implementation(GROUPED_DECODE_SDPA)
        params = self.snapshot.state_dict()
        self._device = next(iter(params.values())).device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        # A tied lm_head shares the embedding's storage: loading the embedding loads it.
        self._names = [name for name in params if not _is_tied(self.snapshot, name)]

    @contextlib.contextmanager
    def _on_generator_stream(self):
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            yield

    def stage(self, named_tensors: NamedTensors) -> StagedWeights:
        wanted = set(self._names)
        staged = stage_copy(
            ((name, tensor) for name, tensor in as_pairs(named_tensors) if name in wanted),
            lambda tensor: tensor.to(self._device, copy=True),
        )
        missing = [name for name in self._names if name not in staged.tensors]
        if missing:
            raise KeyError(f"the policy's weights lack {missing[:5]} (of {len(missing)}) for the snapshot")
        return staged

    def load(self, staged: StagedWeights) -> float:
        start = time.perf_counter()
        params = self.snapshot.state_dict()
        with self._on_generator_stream(), torch.no_grad():
            wait_until_staged(staged)
            for name, tensor in staged.tensors.items():
                params[name].copy_(tensor)
        return time.perf_counter() - start

    def generate(self, prompt_ids: list[list[int]], stop: threading.Event):
        ids, logprobs, _ = self.generate_until(prompt_ids, stop, None, [0] * len(prompt_ids))
        return ids, logprobs

    def generate_until(
        self,
        prompt_ids: list[list[int]],
        stop: threading.Event,
        interrupt: Callable[[], bool] | None,
        generated: list[int],
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Generate until done or `interrupt()`. Row r's prompt may end with `generated[r]` tokens
        already sampled (a continuation: after a weight update their keys and values are recomputed by the weights
        loaded now), so its budget is the rest of `max_new_tokens`. Returns the new tokens, their log-probs, and per
        row whether it is unfinished (no EOS yet, budget left)."""
        budgets = [self.generation_config.max_new_tokens - done for done in generated]
        generate = functools.partial(
            generate_with_behavior_logprobs,
            self.snapshot,
            prompt_ids,
            self.generation_config,
            self.pad_token_id,
            self.eos_token_ids,
            stop=stop,
            # The snapshot is whole and private: `generate`'s default under ZeRO-3 / FSDP (synced_gpus=True) would
            # run an all_reduce per token from this thread, colliding with the trainer's collectives.
            synced_gpus=False,
            interrupt=interrupt,
            budgets=budgets,
        )
        # The results are copied to the CPU at the end, which waits for this stream's work.
        with self._on_generator_stream(), torch.no_grad():
            if self.compiled:
                try:
                    ids, logprobs = generate(compiled=True)
                    self._compiled_ok = True
                except Exception as error:
                    if self._compiled_ok or stop.is_set():
                        raise
                    logger.warning(
                        "The in-process generator cannot decode with a static cache and compiled steps (%s: %s); it "
                        "uses HF generate as configured from now on (generation_compile=False says so up front).",
                        type(error).__name__,
                        error,
                    )
                    self.compiled = False
            if not self.compiled:
                ids, logprobs = generate(compiled=False)
        eos = set(self.eos_token_ids)
        unfinished = [len(row) < budget and not (row and row[-1] in eos) for row, budget in zip(ids, budgets)]
        return ids, logprobs, unfinished

    def close(self) -> None:
        pass


class _StopWhen(StoppingCriteria):
    """Per row: done once it has sampled an EOS or its budget. For all rows at once (at the same token): once `stop` is
    set (training is ending) or `interrupt()` says so (a newer version is due)."""

    def __init__(
        self,
        stop: threading.Event | None,
        interrupt: Callable[[], bool] | None,
        prompt_width: int,
        budgets: list[int],
        eos_token_ids: list[int],
        capture: _SampledLogprobs,
    ):
        self.stop, self.interrupt, self.prompt_width, self.capture = stop, interrupt, prompt_width, capture
        self.budgets, self.eos, self.done = torch.tensor(budgets), torch.tensor(eos_token_ids), None

    def __call__(self, input_ids, scores, **kwargs):
        self.capture.record(input_ids)
        if self.done is None:
            self.budgets, self.eos = self.budgets.to(input_ids.device), self.eos.to(input_ids.device)
            self.done = torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)
        sampled = input_ids.size(1) - self.prompt_width
        self.done |= torch.isin(input_ids[:, -1], self.eos) | (self.budgets <= sampled)
        if (self.stop is not None and self.stop.is_set()) or (self.interrupt is not None and self.interrupt()):
            return torch.ones_like(self.done)
        return self.done.clone()


def _is_tied(model: PreTrainedModel, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
