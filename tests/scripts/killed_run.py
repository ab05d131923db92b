"""Run by tests/test_async.py: training killed with SIGKILL mid-run, then resumed from its last checkpoint.

    killed_run.py OUT_DIR full|killed|resumed

Each micro-batch's prompts (sorted token ids per row) are appended to OUT_DIR/<mode>.jsonl as soon as the loss sees
them (flushed and synced, so a SIGKILL loses nothing written). `killed` saves a checkpoint every 2 optimizer steps
and SIGKILLs its own process at the end of step 5, while the producer is generating ahead; `resumed` continues from
checkpoint-4 of the killed run with a fresh producer.
"""

import json
import os
import signal
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ for testing_utils

from datasets import Dataset  # noqa: E402
from testing_utils import COMMON, digit_reward, make_model, make_tokenizer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402


out_dir, mode = Path(sys.argv[1]), sys.argv[2]
record = open(out_dir / f"{mode}.jsonl", "a")


class KillAtStep5(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)


tokenizer = make_tokenizer()
dataset = Dataset.from_dict({"prompt": [f"Question {i}: what is {i} plus {i + 1}?" for i in range(24)]})
run_dir = out_dir / ("full" if mode == "full" else "killed")
args = A3POConfig(
    output_dir=str(run_dir),
    **{**COMMON, "steps_per_generation": 3, "max_steps": 9, "save_strategy": "steps", "save_steps": 2},
)
trainer = A3POTrainer(
    model=make_model(tokenizer),
    reward_funcs=digit_reward,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[KillAtStep5()] if mode == "killed" else None,
)
original = trainer._compute_loss


def recording(model, inputs):
    rows = zip(inputs["prompt_ids"].tolist(), inputs["prompt_mask"].tolist())
    record.write(json.dumps(sorted([i for i, m in zip(ids, mask) if m] for ids, mask in rows)) + "\n")
    record.flush()
    os.fsync(record.fileno())
    return original(model, inputs)


trainer._compute_loss = recording
trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-4") if mode == "resumed" else None)
