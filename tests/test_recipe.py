"""The user's doors, end to end on a tiny model and the local GSM8K files: the recipe (full, LoRA, two
processes), the evaluation script on its outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from testing_utils import free_port, make_model, make_tokenizer


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
        str(REPO / "recipes" / "gsm8k.py"),
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(GSM8K),
        "--train_limit",
        "64",
        "--output_dir",
        str(output_dir),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--steps_per_generation",
        "2",
        "--max_completion_length",
        "8",
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        "--greedy_eval_steps",
        "3",
        "--greedy_eval_limit",
        "4",
        "--greedy_eval_max_new_tokens",
        "8",
        "--format_reward_weight",
        "0.1",
        *extra,
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
    out = run(
        [
            sys.executable,
            str(REPO / "recipes" / "eval_gsm8k.py"),
            "--model",
            str(model_dir),
            "--dataset",
            str(GSM8K),
            "--limit",
            "4",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "8",
            *extra,
        ]
    )
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
    run(
        [
            sys.executable,
            *recipe_args(
                tiny_model_dir,
                tmp_path / "lora",
                "--use_peft",
                "--lora_r",
                "4",
                "--lora_alpha",
                "8",
                "--lora_target_modules",
                "q_proj",
                "v_proj",
            ),
        ]
    )
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
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tmp_path / "lora"
    )
    expected = gsm8k_greedy_accuracy(
        load_gsm8k(str(GSM8K), "test", limit=4), tokenizer, model=model, batch_size=2, max_new_tokens=8, progress=False
    )
    assert {key: result[key] for key in expected} == expected


def test_recipe_two_processes(tiny_model_dir, tmp_path):
    port = free_port()
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--main_process_port",
            str(port),
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            *recipe_args(tiny_model_dir, tmp_path / "ddp"),
        ]
    )
    steps = [h for h in trainer_log(tmp_path / "ddp") if "a3po/staleness/max" in h]
    # two processes, one log: the first generation batch is fresh, and no step exceeds the bound (2)
    assert [h["a3po/staleness/max"] for h in steps][:2] == [0, 0] and max(h["a3po/staleness/max"] for h in steps) <= 2


def test_format_reward_only_when_correct_pays_boxed_correct_answers_only():
    import runpy

    from trl_a3po import gsm8k_accuracy_reward, gsm8k_correct_format_reward, gsm8k_format_reward

    recipe = runpy.run_path(str(REPO / "recipes" / "gsm8k.py"))
    script = recipe["ScriptArguments"]
    assert recipe["rewards"](script()) == ([gsm8k_accuracy_reward], [1.0])
    assert recipe["rewards"](script(format_reward_weight=0.5)) == (
        [gsm8k_accuracy_reward, gsm8k_format_reward],
        [1.0, 0.5],
    )
    assert recipe["rewards"](script(format_reward_weight=0.5, format_reward_only_when_correct=True)) == (
        [gsm8k_accuracy_reward, gsm8k_correct_format_reward],
        [1.0, 0.5],
    )
    with pytest.raises(ValueError, match="format_reward_only_when_correct=True needs format_reward_weight > 0"):
        script(format_reward_only_when_correct=True)


@pytest.mark.parametrize("gpu", [False, True])
def test_without_config_the_recipe_takes_the_yaml_for_the_hardware(monkeypatch, gpu):
    """`accelerate launch recipes/gsm8k.py` with no --config: gsm8k_cpu.yaml (the README's main command: SmolLM2, the
    addition task, one-shot, accuracy + 0.5 x format, 64 tokens, max_staleness 2) without a GPU, gsm8k.yaml (the
    paper's setup) with one. The yaml's values as the recipe parses them; the run itself is the README's command."""
    import runpy

    import torch
    from trl import ModelConfig, TrlParser

    from trl_a3po import A3POConfig

    recipe = runpy.run_path(str(REPO / "recipes" / "gsm8k.py"))  # not as __main__: nothing runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.chdir(REPO)
    config = recipe["default_config"]()
    assert config == os.path.join("recipes", "gsm8k.yaml" if gpu else "gsm8k_cpu.yaml")
    if gpu:
        return
    script, args, model = TrlParser((recipe["ScriptArguments"], A3POConfig, ModelConfig)).parse_args_and_config(
        args=["--config", config, "--output_dir", "unused"]
    )
    assert model.model_name_or_path == "smollm2-135m-instruct" and script.dataset_name == "recipes/data/addition"
    assert script.one_shot_prompt and script.format_reward_weight == 0.5
    assert (args.max_staleness, args.max_completion_length, args.learning_rate) == (2, 64, 2e-5)
    assert args.use_cpu and not args.bf16 and args.async_generation and args.prox_logp_method == "loglinear"


@pytest.mark.parametrize(
    "script,expected",
    [("gsm8k.py", "--prox_logp_method"), ("eval_gsm8k.py", "--vllm-url"), ("gsm8k_tools.py", "--tool_timeout_s")],
)
def test_help_prints(script, expected):
    # argparse formats help texts with %: a bare % in a field's help crashed `--help`
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes" / script), "--help"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout


def test_config_help_texts_quote_no_measurements():
    # Figures go stale in help texts; they belong in benchmarks/RESULTS.md.
    import re
    from dataclasses import fields

    from trl import GRPOConfig

    from trl_a3po import A3POConfig

    own = {f.name for f in fields(A3POConfig)} - {f.name for f in fields(GRPOConfig)}
    for f in fields(A3POConfig):
        if f.name in own:
            assert not re.search(r"\d(\.\d+)?x\b|\d%", f.metadata["help"]), f.name


def load_recipe(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_recipes_calculator_evaluates_arithmetic_only():
    calculator = load_recipe("gsm8k_tools").calculator
    assert calculator("(48 + 24) / 2") == "36"
    assert calculator("1,200 * 3 - 7 // 2") == "3597"
    assert calculator("10 / 4") == "2.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os').system('ls')", "x + 1", "2 ** 1000", "[1, 2]"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_the_tool_recipe_trains_with_its_tool_generated_ahead(tmp_path, tool_tokenizer, tool_model_weights):
    from testing_utils import tool_model_saved

    model_dir = tool_model_saved(tmp_path / "model", tool_tokenizer, tool_model_weights)
    run(
        [
            sys.executable,
            str(REPO / "recipes" / "gsm8k_tools.py"),
            "--config",
            str(REPO / "recipes" / "gsm8k_tools.yaml"),
            "--model_name_or_path",
            str(model_dir),
            "--dtype",
            "float32",
            "--dataset_name",
            str(GSM8K),
            "--train_limit",
            "16",
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "1",
            "--steps_per_generation",
            "2",
            "--max_completion_length",
            "64",
            "--use_vllm",  # the yaml's server, replaced by the in-process generator
            "false",
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--gradient_checkpointing",
            "false",
            "--save_strategy",
            "no",
        ]
    )
    history = trainer_log(tmp_path / "out")
    batches = [h for h in history if "tools/call_frequency" in h]
    assert len(batches) == 2 and all("a3po/tools/wait_s" in h for h in batches)  # per generation batch: TRL's, ours
    staleness = [h["a3po/staleness/max"] for h in history if "a3po/staleness/max" in h]
    assert len(staleness) == 4 and staleness[:2] == [0, 0] and max(staleness) <= 2


def test_the_tool_recipes_gpu_config_parses():
    from trl import ModelConfig, TrlParser

    from trl_a3po import A3POConfig

    script, args, model = TrlParser(
        (load_recipe("gsm8k_tools").ScriptArguments, A3POConfig, ModelConfig)
    ).parse_args_and_config(  # (bf16 off: this machine has no GPU; the rest is the yaml's)
        args=["--config", str(REPO / "recipes" / "gsm8k_tools.yaml"), "--output_dir", "unused", "--bf16", "false"]
    )
    assert model.model_name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert (args.max_tool_calling_iterations, args.tool_timeout_s, args.turn_weight_updates) == (4, 10.0, True)
    # TRL's use_vllm=True, vllm_mode='server': generated ahead on the server, TRL's own vLLM client not built
    assert args.async_generation and args.rollout_backend == "vllm_server" and not args.use_vllm
