"""The user's doors, end to end on a tiny model and the local GSM8K files: the recipe (full, LoRA, two
processes), the evaluation script on its outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, make_model, make_tokenizer

REPO = Path(__file__).resolve().parent.parent
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
GSM8K = SHARED_GSM8K if SHARED_GSM8K.exists() else REPO / "recipes" / "data" / "gsm8k"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def recipe_args(model_dir, output_dir, *extra):
    return [
        str(REPO / "recipes" / "gsm8k.py"), "--model_name_or_path", str(model_dir), "--dataset_name", str(GSM8K),
        "--train_limit", "64", "--output_dir", str(output_dir), "--max_steps", "3", "--per_device_train_batch_size",
        "4", "--num_generations", "4", "--steps_per_generation", "2", "--max_completion_length", "8",
        "--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--save_strategy", "no", "--logging_steps",
        "1", "--greedy_eval_steps", "3", "--greedy_eval_limit", "4", "--greedy_eval_max_new_tokens", "8",
        "--format_reward_weight", "0.1", *extra,
    ]


def run(cmd, timeout=900):
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + "\n" + result.stderr[-6000:]
    return result


def trainer_log(output_dir):
    # the recipe saves the model and the trainer state at the end
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return state["log_history"]


def evaluate(model_dir, *extra):
    out = run([sys.executable, str(REPO / "recipes" / "eval_gsm8k.py"), "--model", str(model_dir), "--dataset",
               str(GSM8K), "--limit", "4", "--batch-size", "2", "--max-new-tokens", "8", *extra])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_recipe_full_finetune_then_eval(tiny_model_dir, tmp_path):
    run([sys.executable, *recipe_args(tiny_model_dir, tmp_path / "out")])
    history = trainer_log(tmp_path / "out")
    steps = [h for h in history if "a3po/staleness/max" in h]
    # 2 optimizer steps per generation batch (one policy version), one batch ahead: the first batch is fresh
    staleness = [h["a3po/staleness/max"] for h in steps]
    assert staleness[:2] == [0, 0] and staleness[2] <= 1
    assert "rewards/gsm8k_accuracy_reward/mean" in history[0]
    evals = [h["eval/gsm8k_greedy_accuracy"] for h in history if "eval/gsm8k_greedy_accuracy" in h]
    assert (tmp_path / "out" / "model.safetensors").exists()
    result = evaluate(tmp_path / "out")
    # the script on the saved model repeats the callback's evaluation of the final weights (same 4 problems)
    assert result["total"] == 4 and result["accuracy"] == evals[-1]


def test_recipe_lora_then_eval_the_adapter(tiny_model_dir, tmp_path):
    run([sys.executable, *recipe_args(tiny_model_dir, tmp_path / "lora", "--use_peft", "--lora_r", "4",
                                      "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj")])
    assert (tmp_path / "lora" / "adapter_config.json").exists()
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(tmp_path / "lora").r == 4
    result = evaluate(tiny_model_dir, "--adapter", str(tmp_path / "lora"))
    # the script evaluates base + the saved adapter on the problems asked for: the same result as that model here
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_a3po import gsm8k_greedy_accuracy, load_gsm8k

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      tmp_path / "lora")
    expected = gsm8k_greedy_accuracy(load_gsm8k(str(GSM8K), "test", limit=4), tokenizer, model=model, batch_size=2,
                                     max_new_tokens=8, progress=False)
    assert {key: result[key] for key in expected} == expected


def test_recipe_two_processes(tiny_model_dir, tmp_path):
    port = free_port()
    run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend",
         "no", *recipe_args(tiny_model_dir, tmp_path / "ddp")])
    steps = [h for h in trainer_log(tmp_path / "ddp") if "a3po/staleness/max" in h]
    # two processes, one log: the first generation batch is fresh, and no step exceeds the bound (2)
    assert [h["a3po/staleness/max"] for h in steps][:2] == [0, 0] and max(h["a3po/staleness/max"] for h in steps) <= 2


def test_design_card_form_runs_the_cpu_demo_config_for_two_steps(tmp_path):
    """`accelerate launch recipes/gsm8k.py` with no --config on a machine without a GPU: the recipe takes
    recipes/gsm8k_cpu.yaml (the README's main command), the real SmolLM2-135M-Instruct and the addition task; two
    optimizer steps (one policy version) here."""
    out = run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", str(REPO / "recipes" / "gsm8k.py"), "--max_steps", "2",
               "--output_dir", str(tmp_path / "demo")], timeout=1200)
    assert "no --config given: using recipes/gsm8k_cpu.yaml" in out.stdout
    import torch

    args = torch.load(tmp_path / "demo" / "training_args.bin", weights_only=False)
    assert (args.max_staleness, args.max_completion_length, args.learning_rate) == (2, 64, 2e-5)
    assert args.reward_weights == [1.0, 0.5]  # accuracy + 0.5 x format, from the yaml
    history = trainer_log(tmp_path / "demo")
    steps = [h for h in history if "a3po/staleness/max" in h]
    assert [h["step"] for h in steps] == [1, 2] and [h["a3po/staleness/max"] for h in steps] == [0, 0]
    first = history[0]
    assert first["completions/max_length"] <= 64
    # the reward is the weighted sum of its parts, as logged (8 samples of the addition task)
    assert first["reward"] == pytest.approx(first["rewards/gsm8k_accuracy_reward/mean"]
                                            + 0.5 * first["rewards/gsm8k_format_reward/mean"])
