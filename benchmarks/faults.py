"""How fast each generation-server fault stops training, measured against tests/standin_server.py (loopback) with a
tiny model on CPU: the time from `train()`'s start to the error, and from the fault itself where it has a moment.

    python benchmarks/faults.py                 # ~1 minute; prints one table (docs/reliability.md)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from datasets import Dataset  # noqa: E402
from testing_utils import digit_reward, make_model, make_tokenizer  # noqa: E402

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402

from standin_server import StandinServer  # noqa: E402


CASES = {
    "no dev mode (start-up probe)": dict(dev_mode=False),
    "push fails (500 on reload)": dict(push_fails=True),
    "error event mid-stream": dict(completions="error"),
    "row without finish_reason": dict(completions="unfinished"),
    "restarted server (weights relabelled)": dict(restart_at=2),
    "stalled server, vllm_server_timeout=5": dict(completions="stall", stall_s=60),
}


def main():
    tokenizer = make_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Question {i}: what is {i} plus {i + 1}?" for i in range(24)]})
    rows = []
    for name, server_kwargs in CASES.items():
        with StandinServer(**server_kwargs) as server:
            args = A3POConfig(
                output_dir=tempfile.mkdtemp(prefix="faults-"),
                rollout_backend="vllm_server",
                vllm_server_port=server.port,
                weight_sync_transport="disk",
                vllm_server_timeout=5.0,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=8,
                max_steps=4,
                report_to="none",
                use_cpu=True,
                save_strategy="no",
                seed=0,
                bf16=False,
                disable_tqdm=True,
                logging_steps=1,
            )
            trainer = A3POTrainer(
                model=make_model(tokenizer),
                reward_funcs=digit_reward,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
            start = time.monotonic()
            try:
                trainer.train()
                outcome = "NOT DETECTED"
            except Exception as error:  # what the user sees
                outcome = f"{type(error).__name__}: {str(error)[:90]}..."
            rows.append((name, time.monotonic() - start, trainer.state.global_step, outcome))
    print(f"\n{'fault':<40}{'s to error':>11}{'steps':>7}  error")
    for name, seconds, steps, outcome in rows:
        print(f"{name:<40}{seconds:>11.1f}{steps:>7}  {outcome}")


if __name__ == "__main__":
    main()
