"""Greedy GSM8K accuracy (the paper's "final eval reward") of a model, a checkpoint or a LoRA adapter.

    python recipes/eval_gsm8k.py --model smollm2-135m-instruct --dataset recipes/data/gsm8k --limit 200
    # the CPU demo's model (recipes/gsm8k_cpu.yaml) on its held-out addition problems, with its prompt and budget
    python recipes/eval_gsm8k.py --model outputs/gsm8k-cpu --dataset recipes/data/addition --one-shot \
        --max-new-tokens 64 --batch-size 50
    # a PEFT adapter on its base (docs/lora.md)
    python recipes/eval_gsm8k.py --model smollm2-135m-instruct --adapter outputs/gsm8k-lora \
        --dataset recipes/data/addition --one-shot --max-new-tokens 64
    # GPU, on a running vLLM server (docs/backends.md), from the hub
    python recipes/eval_gsm8k.py --model Qwen/Qwen2.5-1.5B-Instruct --vllm-url http://127.0.0.1:8000

The data: a hub id (openai/gsm8k, the default, needs the network) or a folder with test.jsonl.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_a3po import gsm8k_greedy_accuracy, load_gsm8k, resolve_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="hub id, local folder, or smollm2-135m-instruct")
    parser.add_argument("--adapter", help="a PEFT (LoRA) adapter folder to load on top of --model")
    parser.add_argument("--dataset", default="openai/gsm8k", help="hub id, or a folder with test.jsonl")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=200, help="first N problems (0 = all)")
    parser.add_argument("--max-solution-steps", type=int, help="only problems with <= N calculator steps")
    parser.add_argument("--one-shot", action="store_true", help="prompts start with a short worked example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--vllm-url", help="generate on this vLLM server instead of HF generate")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output", help="also write the result as JSON here")
    args = parser.parse_args()

    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.adapter or model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_gsm8k(args.dataset, args.split, args.limit or None, args.max_solution_steps, args.one_shot)
    model = None
    if args.vllm_url is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
        if args.adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, args.adapter)
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    result = gsm8k_greedy_accuracy(
        dataset,
        tokenizer,
        model=model,
        vllm_base_url=args.vllm_url,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    result.update(
        model=args.model,
        adapter=args.adapter,
        dataset=args.dataset,
        split=args.split,
        max_solution_steps=args.max_solution_steps,
        one_shot=args.one_shot,
        max_new_tokens=args.max_new_tokens,
    )
    print(json.dumps(result))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
