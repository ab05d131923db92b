"""A3POTrainer with the colocated vLLM engine (TRL's use_vllm=True, vllm_mode='colocate'), run by
tests/test_vllm_colocate.py with the Python of the vLLM venv (vLLM must be importable in the training process).

Usage: python colocated_run.py MODE OUT_DIR (or under `accelerate launch`: every process runs it), MODE one of:
  train: 16 asynchronous steps (8 versions); reports the staleness, the per-token version invariant (every trained
         token's behaviour log-prob against its recorded version's weights), the prompts scored per generation
         batch, and those of a synchronous run in the same processes.
  fault: the optimizer raises at step 3; reports the error and the threads left.
  engine-fault: the engine fails at its second generation; reports the error and the threads left.
Writes OUT_DIR/result-RANK.json.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: testing_utils

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from testing_utils import (  # noqa: E402
    COMMON,
    VersionRecorder,
    check_behaviour_logprobs_against_versions,
    digit_reward,
    logged,
    make_tokenizer,
    producer_threads,
    record_trained_samples,
)
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402


mode, out_dir = sys.argv[1], Path(sys.argv[2])
model_dir = out_dir / "model"
tokenizer = make_tokenizer()
if not model_dir.exists():
    from test_vllm_server import make_server_model  # vLLM's CPU attention needs its head size

    make_server_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
dataset = Dataset.from_dict({"prompt": [f"Question {i}: what is {i} plus {i + 1}?" for i in range(24)]})
settings = {**COMMON, "steps_per_generation": 2, "max_steps": 16, "learning_rate": 1e-2, "max_staleness": 2}
colocated = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)  # TRL's fields, as they are
rank = int(os.environ.get("RANK", 0))


def trainer_for(**kwargs):
    """A trainer whose reward function records the prompts of each generation batch, in training order."""
    args = A3POConfig(output_dir=str(out_dir / "run"), **{**settings, **kwargs})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # name_or_path: vLLM's checkpoint
    scored = []

    def recorded_digit_reward(prompts, completions, **kwargs):
        scored.append(list(prompts))
        return digit_reward(completions)

    trainer = A3POTrainer(
        model=model, reward_funcs=recorded_digit_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    return trainer, scored


result = {}
if mode == "train":
    synchronous, sync_prompts = trainer_for(async_generation=False)
    synchronous.train()
    trainer, prompts = trainer_for(**colocated)
    versions = VersionRecorder(trainer)
    trainer.add_callback(versions)
    samples = record_trained_samples(trainer)
    start = time.monotonic()
    trainer.train()
    result.update(
        rollout_backend=trainer.args.rollout_backend,
        use_vllm=trainer.args.use_vllm,
        staleness=logged(trainer, "a3po/staleness/max"),
        weight_sync_s=logged(trainer, "a3po/gen/weight_sync_s"),
        checked=check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3),
        behaviour_versions=sorted({int(v) for s in samples for v in s["behavior_version"].unique()}),
        prompts=prompts,
        sync_prompts=sync_prompts,
        train_s=time.monotonic() - start,
    )
elif mode in ("fault", "engine-fault"):
    trainer, _ = trainer_for(**colocated)
    if mode == "fault":

        class Fault(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    raise RuntimeError("optimizer fault (injected)")

        trainer.add_callback(Fault())
    else:
        from trl_a3po.rollout.vllm_colocate import VLLMColocateBackend

        generate, calls = VLLMColocateBackend.generate, []

        def failing_generate(self, prompt_ids, stop):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("engine failure (injected)")
            return generate(self, prompt_ids, stop)

        VLLMColocateBackend.generate = failing_generate
    start = time.monotonic()
    try:
        trainer.train()
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    result["seconds_to_error"] = time.monotonic() - start
else:
    raise SystemExit(f"unknown mode {mode!r}")
result["threads_left"] = [t.name for t in producer_threads()]
result["other_threads"] = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
(out_dir / f"result-{rank}.json").write_text(json.dumps(result))
os._exit(0)  # vLLM's engine threads need no orderly teardown once everything is reported
