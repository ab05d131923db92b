"""Run by tests/test_accelerate.py under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo): a few steps
on a tiny model, writing each rank's scored prompts and the logged staleness to OUT_DIR/<mode>-rank<r>.json."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ for conftest helpers

from conftest import digit_reward, make_model, make_tokenizer  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
seen = []


def recorded_reward(prompts, completions, **kwargs):
    seen.append(list(prompts))
    return digit_reward(completions)


tokenizer = make_tokenizer()
dataset = Dataset.from_dict({"prompt": [f"Question {i}: what is {i} plus {i + 1}?" for i in range(32)]})
args = A3POConfig(
    output_dir=str(out_dir / mode), per_device_train_batch_size=2, num_generations=4, max_completion_length=6,
    steps_per_generation=2, max_steps=6, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
    seed=0, bf16=False, learning_rate=1e-3, async_generation=(mode == "async"),
)
trainer = A3POTrainer(model=make_model(tokenizer), reward_funcs=recorded_reward, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
trainer.train()
rank = trainer.accelerator.process_index
staleness = [h["a3po/staleness/max"] for h in trainer.state.log_history if "a3po/staleness/max" in h]
(out_dir / f"{mode}-rank{rank}.json").write_text(
    json.dumps({"prompts": seen, "staleness_max": staleness, "eta": args.max_staleness,
                "world": trainer.accelerator.num_processes})
)
