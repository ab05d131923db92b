"""What A3POTrainer accepts of GRPOTrainer's arguments: every refusal, once, before any model work (loading, PEFT,
Accelerate wrapping), each naming what to change. A3POConfig's own fields are checked in its `__post_init__`."""

from __future__ import annotations

import os

import torch
from accelerate.utils import is_peft_model

from .config import A3POConfig
from .rollout.backend import backend_entry


PEFT_ON_SHARDS = (
    "async_generation=True with a PEFT adapter on sharded parameters (FSDP or DeepSpeed ZeRO-3) is not supported (the "
    "merged weights would have to be built from shards); set async_generation=False, or train the adapter with DDP / "
    "ZeRO-2 (a LoRA model fits on one GPU)."
)


def check_supported(args: A3POConfig, given: dict) -> None:
    """Every refusal of GRPOTrainer's arguments, before any model work (loading, PEFT, Accelerate wrapping), each
    naming what to change; `given` is GRPOTrainer's arguments. (A3POConfig's own fields: its `__post_init__`.)"""
    dataset = given.get("train_dataset")
    images = set(getattr(dataset, "column_names", None) or []) & {"image", "images"}
    if images and args.use_decoupled_loss:
        raise ValueError(
            "A3POTrainer's decoupled loss is text-only: the image inputs of this dataset (its "
            f"{sorted(images)} column) would be dropped from the loss and the proximal forward, training a different "
            "policy than the one that generated. Set use_decoupled_loss=False (GRPOTrainer's own loss) for "
            "vision-language models, or drop the image column."
        )
    if args.async_generation:
        _check_supported_async(args, given, images)
    _check_train_dataset(args, dataset)


def _check_supported_async(args: A3POConfig, given: dict, images: set) -> None:
    multi_turn = given.get("tools") or given.get("environment_factory") is not None
    if (multi_turn or given.get("rollout_func") is not None) and args.continuous_generation:
        raise ValueError(
            "continuous_generation=True streams the single-turn rows of several batches as requests of their own; "
            "with tools, an environment_factory or a rollout_func the producer plays episodes instead (their turns "
            "generated together, their tool calls concurrent, a newer version loaded between turns). Set "
            "continuous_generation=False."
        )
    if images:
        raise ValueError(
            f"async_generation=True generates from text prompts alone: this dataset's {sorted(images)} column would "
            "never reach the generator. Set async_generation=False for vision-language models."
        )
    # Sharded parameters, as far as can be told before the Accelerator exists: `accelerate launch` exports its FSDP
    # and DeepSpeed settings as environment variables; TrainingArguments has its own `fsdp` field. (`__init__`
    # checks again once Accelerate knows the setup.)
    sharded = (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        or bool(args.fsdp)
        or os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    )
    model = given.get("model")
    peft_model = isinstance(model, torch.nn.Module) and is_peft_model(model)  # not a name or path: already loaded
    if sharded and (given.get("peft_config") is not None or peft_model):
        raise ValueError(PEFT_ON_SHARDS)
    peft_config = given.get("peft_config") or (model.peft_config if peft_model else None)
    if peft_config is None:
        return
    if args.lora_weight_sync == "adapter":  # (a backend without adapters is refused by the config)
        unservable_adapter = backend_entry(args.rollout_backend).unservable_adapter
        reason = unservable_adapter(peft_config if isinstance(peft_config, dict) else {"default": peft_config})
        if reason:
            raise ValueError(
                f"lora_weight_sync='adapter' cannot serve {reason}; set lora_weight_sync='auto' (merged "
                "weights for such a policy) or 'merged'."
            )
    unservable = _adapter_the_generator_cannot_run(peft_config)
    if unservable:
        raise ValueError(
            f"async_generation=True generates with the policy's merged weights, which cannot represent {unservable}: "
            "the generator would run a different policy than the one trained. Use a plain LoRA adapter, or set "
            "async_generation=False."
        )


def _check_train_dataset(config: A3POConfig, dataset) -> None:
    """Rows without a usable prompt, and a dataset too small for one generation batch, named before any model work
    (TRL would fail inside the tokenizer naming no row, or train nothing and say nothing)."""
    if (
        dataset is None
        or not hasattr(dataset, "__len__")
        or "prompt" not in (getattr(dataset, "column_names", None) or [])
    ):
        return  # streamed datasets (no length to check) and custom collations: TRL's business
    needed = config.generation_batch_size // config.num_generations  # distinct prompts in one generation batch
    if len(dataset) < needed:
        raise ValueError(
            f"train_dataset has {len(dataset)} rows, fewer than the {needed} distinct prompts of one generation batch "
            f"(generation_batch_size {config.generation_batch_size} / num_generations {config.num_generations}): "
            "nothing could be trained. Use a larger dataset or a smaller per_device_train_batch_size / "
            "steps_per_generation."
        )
    for row, prompt in enumerate(dataset["prompt"]):
        if isinstance(prompt, str):
            usable = bool(prompt.strip())
        else:  # conversational: a non-empty list of {"role", "content"} messages
            usable = (
                isinstance(prompt, list)
                and bool(prompt)
                and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
            )
        if not usable:
            raise ValueError(
                f"train_dataset row {row}: its 'prompt' is {str(prompt)[:100]!r}, not usable as a prompt (a non-empty "
                "string, or a non-empty list of {'role', 'content'} messages). Fix or drop that row."
            )


def _adapter_the_generator_cannot_run(peft_config) -> str | None:
    """What of a PEFT config the generator's merged export (W + scale * B @ A, PEFT's own `get_delta_weight`) would not
    reproduce, named; None when every adapter is a plain LoRA."""
    from peft import LoraConfig

    configs = peft_config.values() if isinstance(peft_config, dict) else [peft_config]
    for config in configs:
        if not isinstance(config, LoraConfig):
            return f"a {type(config).__name__} adapter (only LoRA's delta can be merged into the generator's weights)"
        if config.use_dora:
            return "LoRA with use_dora=True (DoRA rescales by a magnitude vector that is not part of the LoRA delta)"
        if getattr(config, "lora_bias", False):
            return "LoRA with lora_bias=True (the bias delta is not part of the LoRA weight delta)"
    return None
