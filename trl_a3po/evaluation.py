"""Greedy GSM8K accuracy: the paper's "final eval reward", with HF generate or a vLLM server."""

from __future__ import annotations

import contextlib

import requests
import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback
from trl.models.utils import unwrap_model_for_generation

from .rewards import gsm8k_accuracy_reward
from .rollout.inprocess import left_pad


def _render(tokenizer, prompts) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for prompt in prompts
    ]


@torch.no_grad()
def generate_greedy_hf(
    model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, synced_gpus: bool | None = None
) -> list[str]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids, attention_mask = left_pad(prompt_ids, pad)
    width = input_ids.size(1)
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        synced_gpus=synced_gpus,
    )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def generate_greedy_vllm(base_url: str, prompt_ids: list[list[int]], max_new_tokens: int) -> list[str]:
    session = requests.Session()
    model = session.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    response = session.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": 0.0},
        timeout=3600,
    )
    response.raise_for_status()
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def gsm8k_greedy_accuracy(
    dataset,
    tokenizer,
    model=None,
    vllm_base_url: str | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 512,
    progress: bool = True,
    synced_gpus: bool | None = None,
) -> dict:
    """Greedy (temperature 0) accuracy on `dataset` (rows with `prompt` and `answer`, as `load_gsm8k` gives).
    `synced_gpus` is `generate`'s: True when every process generates with sharded parameters."""
    if (model is None) == (vllm_base_url is None):
        raise ValueError("pass exactly one of model (HF generate) or vllm_base_url")
    correct, total = 0.0, 0
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    bar = tqdm(total=len(dataset), desc="GSM8K greedy eval", disable=not progress)
    try:
        for start in range(0, len(dataset), batch_size):
            rows = dataset[start : start + batch_size]
            prompt_ids = _render(tokenizer, rows["prompt"])
            if model is not None:
                texts = generate_greedy_hf(model, tokenizer, prompt_ids, max_new_tokens, synced_gpus=synced_gpus)
            else:
                texts = generate_greedy_vllm(vllm_base_url, prompt_ids, max_new_tokens)
            correct += sum(gsm8k_accuracy_reward(texts, rows["answer"]))
            total += len(texts)
            bar.update(len(texts))
            bar.set_postfix(accuracy=f"{correct / total:.3f}")
    finally:
        bar.close()
        if model is not None and was_training:
            model.train()
    return {"accuracy": correct / max(total, 1), "correct": int(correct), "total": total}


class GreedyEvalCallback(TrainerCallback):
    """Greedy GSM8K accuracy every `every_steps` optimizer steps (and at the end), logged as
    `eval/gsm8k_greedy_accuracy`. Without sharding the main process evaluates and the others wait; with sharded
    parameters (DeepSpeed ZeRO-3, FSDP) every forward gathers shards, a collective, so every process generates the
    same prompts in step (`synced_gpus`) and the main process logs the result."""

    def __init__(self, dataset, tokenizer, every_steps: int, batch_size: int = 16, max_new_tokens: int = 512):
        self.dataset, self.tokenizer = dataset, tokenizer
        self.every_steps, self.batch_size, self.max_new_tokens = every_steps, batch_size, max_new_tokens
        self.trainer = None  # set by the recipe: the trainer whose model and log() to use

    @contextlib.contextmanager
    def _model_for_generation(self, sharded: bool):
        trainer = self.trainer
        if not sharded:
            yield trainer.accelerator.unwrap_model(trainer.model)
            return
        # TRL's own context for generating with a sharded model (ZeRO-3: gathered; FSDP: full parameters summoned).
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            ) as model,
            trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
        ):
            yield model

    def _evaluate(self) -> float | None:
        trainer = self.trainer
        sharded = trainer._dist.is_zero3 or trainer._dist.is_fsdp
        is_main = trainer.accelerator.is_main_process
        accuracy = None
        if sharded or is_main:
            with self._model_for_generation(sharded) as model:
                accuracy = gsm8k_greedy_accuracy(
                    self.dataset,
                    self.tokenizer,
                    model=model,
                    batch_size=self.batch_size,
                    max_new_tokens=self.max_new_tokens,
                    progress=False,
                    synced_gpus=sharded,
                )["accuracy"]
        trainer.accelerator.wait_for_everyone()
        return accuracy if is_main else None

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_steps and state.global_step % self.every_steps == 0:
            accuracy = self._evaluate()
            if accuracy is not None:  # logged with this step's metrics
                self.trainer._metrics["train"]["eval/gsm8k_greedy_accuracy"].append(accuracy)

    def on_train_end(self, args, state, control, **kwargs):
        if self.every_steps and state.global_step % self.every_steps != 0:
            accuracy = self._evaluate()
            if accuracy is not None:
                self.trainer.log({"eval/gsm8k_greedy_accuracy": accuracy})
