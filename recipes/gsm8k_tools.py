"""A-3PO with a tool: GSM8K with a calculator the model may call, in one file.

    accelerate launch recipes/gsm8k_tools.py --config recipes/gsm8k_tools.yaml     # Qwen2.5-1.5B-Instruct (GPUs)

Generated ahead (A3POConfig's default), each episode runs in the producer: the model answers, TRL parses its tool
calls (Qwen2.5's template renders the tool and its calls), the calculator runs off the training thread (episodes
concurrently, each call bounded by `tool_timeout_s`), its result is appended and the model continues, up to
`max_tool_calling_iterations`. Tool results are never trained (TRL's `tool_mask`); every model token keeps the policy
version that sampled it, and a newer version may serve the turns after a tool result (`turn_weight_updates`). The
reward is GSM8K accuracy of the final answer (and, weighted, its \\boxed{} format).

Every A3POConfig / GRPOConfig / TrainingArguments and ModelConfig field is a flag; flags override the yaml;
`python recipes/gsm8k_tools.py --help` lists them. The model's chat template must support tool calls (TRL checks):
SmolLM2's does not, so there is no CPU config; tests/test_recipe.py runs this file on a tiny model whose does.
"""

import ast
import operator
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from trl_a3po import (
    A3POConfig,
    A3POTrainer,
    gsm8k_accuracy_reward,
    gsm8k_correct_format_reward,
    load_gsm8k,
    resolve_model,
)


# The calculator: arithmetic on numbers only, evaluated on Python's syntax tree (never `eval`: the expression is
# model output). Written here because no library this project uses evaluates untrusted arithmetic.
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        if isinstance(node.op, ast.Pow) and abs(_evaluate(node.right)) > 100:
            raise ValueError("exponent too large")
        return OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(48 + 24) / 2".
    """
    value = _evaluate(ast.parse(expression.replace(",", ""), mode="eval").body)
    return str(int(value) if float(value).is_integer() else round(value, 6))


@dataclass
class ScriptArguments:
    dataset_name: str = field(
        default="openai/gsm8k",
        metadata={"help": "Hub id (config 'main'), or a local folder with train.jsonl/test.jsonl, or a jsonl file."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    train_limit: int | None = field(default=None, metadata={"help": "Use only the first N training problems."})
    format_reward_weight: float = field(
        default=0.0,
        metadata={"help": "Weight of a reward paid to a correct answer in \\boxed{} (0 = accuracy only)."},
    )


def main(script_args: ScriptArguments, training_args: A3POConfig, model_args: ModelConfig):
    model_path = resolve_model(model_args.model_name_or_path)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    # `prompt` (chat messages asking for \boxed{}) and `answer` (the reference, read by the reward).
    train_dataset = load_gsm8k(script_args.dataset_name, script_args.dataset_train_split, script_args.train_limit)
    reward_funcs, training_args.reward_weights = [gsm8k_accuracy_reward], [1.0]
    if script_args.format_reward_weight:
        reward_funcs.append(gsm8k_correct_format_reward)
        training_args.reward_weights.append(script_args.format_reward_weight)

    trainer = A3POTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        tools=[calculator],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: its log has TRL's tools/* metrics and a3po/tools/wait_s
    trainer.accelerator.end_training()


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, A3POConfig, ModelConfig))
    main(*parser.parse_args_and_config())
