"""Two CPU processes under `accelerate launch` (gloo): each rank trains its share of the synchronous order, async."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "scripts" / "two_process_run.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out_dir, mode):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # `--cpu` alone starts one process unless MPI is set up; `--multi_gpu` uses torchrun, which on a machine without
    # GPUs (and `use_cpu=True` in the config) runs the processes on CPU over gloo.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), str(out_dir), mode]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads((out_dir / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def test_two_process_async_run_follows_the_synchronous_shards(tmp_path):
    sync = launch(tmp_path, "sync")
    async_ = launch(tmp_path, "async")
    assert [r["world"] for r in async_] == [2, 2]
    for rank in range(2):
        assert async_[rank]["prompts"] == sync[rank]["prompts"], f"rank {rank} trained other prompts"
        assert len(async_[rank]["prompts"]) == 3  # 6 steps / 2 steps per generation batch
    assert async_[0]["prompts"] != async_[1]["prompts"]  # the ranks share the batch, not duplicate it
    staleness = async_[0]["staleness_max"]
    assert len(staleness) == 6 and max(staleness) <= async_[0]["eta"]
