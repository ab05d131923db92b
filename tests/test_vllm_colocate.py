"""The colocated vLLM engine (TRL's `use_vllm=True, vllm_mode="colocate"`, generated ahead), with vLLM's CPU build in
the training process: `tests/scripts/colocated_run.py` runs with the Python of the vLLM venv (scripts/setup.sh
--with-vllm installs the project there too), in one process and in two (gloo)."""

import json
import os
import subprocess

import pytest
from testing_utils import free_port, need_vllm_python


SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "colocated_run.py")


def run(tmp_path, mode, processes=1):
    python = need_vllm_python()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    launcher = [python]
    if processes > 1:
        launcher = [python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
        launcher += ["--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no"]
        launcher += ["--dynamo_backend", "no"]
    result = subprocess.run(
        [*launcher, SCRIPT, mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.parametrize("processes", [1, 2])
def test_the_colocated_engine_generates_ahead_with_a_version_per_token(tmp_path, processes):
    for rank in run(tmp_path, "train", processes):
        # TRL's config, as it is: the producer's colocated engine, GRPOTrainer's own (synchronous) vLLM not built
        assert rank["rollout_backend"] == "vllm_colocate" and rank["use_vllm"] is False
        assert len(rank["staleness"]) == 16 and max(rank["staleness"]) == 2  # generated ahead, to the bound
        # every trained token's behaviour log-prob is its recorded version's (float32, vLLM's CPU kernels vs HF's)
        assert rank["checked"] == 16 * 4  # every row each process trained: 16 micro-batches of 4
        assert len(rank["behaviour_versions"]) >= 5
        assert rank["prompts"] == rank["sync_prompts"]  # the synchronous order, batch by batch
        assert rank["threads_left"] == []


@pytest.mark.parametrize(
    "mode,message", [("fault", "RuntimeError: optimizer fault"), ("engine-fault", "while generating batch")]
)
def test_a_fault_ends_training_with_its_error_and_no_thread_left(tmp_path, mode, message):
    (rank,) = run(tmp_path, mode)
    assert message in rank["error"] and rank["threads_left"] == []
    assert rank["seconds_to_error"] < 60
