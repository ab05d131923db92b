"""Two CPU processes under `accelerate launch` (gloo): each rank trains its share of the synchronous order, async."""

import contextlib
import json
import time

import pytest
from testing_utils import check_ranks_follow_the_synchronous_shards, launch, require_deepspeed


# (In-flight updates alone on two processes: the continuous + in-flight case covers both at once, for CI time; one
# process runs each alone, tests/test_async.py.)
@pytest.mark.parametrize("mode", ["async", "async-continuous-inflight"])
def test_two_process_async_run_follows_the_synchronous_shards(tmp_path, synchronous_shards, mode):
    sync = synchronous_shards
    async_ = launch(tmp_path, mode)
    check_ranks_follow_the_synchronous_shards(sync, async_)
    for rank in range(2):
        # the version invariant, on every token of every sample of every rank (2 samples per step, 8 steps)
        assert async_[rank]["checked"] == 16 and sync[rank]["checked"] == 16
    assert max(async_[0]["staleness_max"]) == 2  # the producer did run ahead
    if mode == "async-continuous-inflight":  # versions did change mid-sequence, on both ranks' producers
        assert async_[0]["mixed"] > 0 and async_[1]["mixed"] > 0


def test_two_processes_record_their_shares_and_a_replay_reproduces_the_run(tmp_path):
    ranks = launch(tmp_path, "async-replay")
    for rank in ranks:
        replayed = rank["replayed"]
        # each process recorded its own share of each of the 4 generation batches, and replayed it, bit for bit
        assert replayed["batch_files"] == [f"{k:06d}-{r}.pt" for k in range(4) for r in range(2)]
        assert replayed["losses"][0] == replayed["losses"][1] and len(replayed["losses"][0]) == 8
        assert replayed["weight_differences"] == {}
    assert max(ranks[0]["staleness_max"]) == 2


def test_two_processes_follow_an_iterable_datasets_synchronous_shards(tmp_path, synchronous_iterable_shards):
    # The stream has no sampler to replay: each process's producer reads its own shard of it (Accelerate shards a
    # 2-shard stream by its shards), ahead of its trainer.
    ranks = launch(tmp_path, "async-iterable")
    check_ranks_follow_the_synchronous_shards(synchronous_iterable_shards, ranks)
    assert [r["checked"] for r in ranks] == [16, 16]
    assert max(ranks[0]["staleness_max"]) == 2


def test_two_processes_under_deepspeed_zero3_train_async_in_process(tmp_path, synchronous_shards):
    # Real DeepSpeed ZeRO-3 (CPU, gloo): the parameters are partitioned, each process's generator snapshot is built
    # whole (never partitioned, never in a collective), and every sample matches its recorded version (1e-5).
    require_deepspeed()
    ranks = launch(tmp_path, "zero3")
    check_ranks_follow_the_synchronous_shards(synchronous_shards, ranks)
    for rank in range(2):
        assert ranks[rank]["partitioned_fraction"] == 0.5  # each process holds half of every parameter
        assert ranks[rank]["checked"] == 16
    assert max(ranks[0]["staleness_max"]) == 2


@pytest.mark.parametrize(
    "when,server_kwargs,mode,message",
    [
        ("start", dict(dev_mode=False), "standin", "without VLLM_SERVER_DEV_MODE=1"),
        ("publish", dict(), "standin-stagefail", "staging failed (injected)"),
        ("generation", dict(completions="error"), "standin", "CUDA out of memory (stand-in)"),
    ],
)
def test_a_failure_of_the_main_process_ends_every_process_with_the_original_error(
    tmp_path, when, server_kwargs, mode, message
):
    # Only the main process talks to the server; whatever fails there (the start-up probe, staging a version, an
    # error event mid-generation; a failed push or a stall travel the same path, tested in one process in
    # test_server_protocol.py) reaches the other process as the original message, and both exit non-zero, quickly.
    from standin_server import StandinServer

    with StandinServer(**server_kwargs) as server:
        start = time.monotonic()
        result = launch(tmp_path, mode, server.port, expect_failure=True)
        elapsed = time.monotonic() - start
    assert result.returncode != 0
    output = result.stdout + result.stderr
    for rank in range(2):
        errors = [line for line in output.splitlines() if line.startswith(f"[rank{rank}]:") and "Error" in line]
        assert any(message in line for line in errors), (rank, errors[-5:])
    assert elapsed < 60


@pytest.mark.parametrize("mode", ["raise-rollout-func", "standin-raise-rollout-func", "raise-reset"])
def test_the_users_exception_in_the_producer_reaches_train_as_itself_on_every_process(
    tmp_path, mode, tool_tokenizer, tool_model_weights
):
    # In-process, each process's own producer raises it; on a server, the main process's producer raises it and sends
    # it to the other process, which raises the same type with the same note.
    from testing_utils import tool_model_saved

    from standin_server import StandinServer

    with contextlib.ExitStack() as stack:
        extra = []
        if mode.startswith("standin"):
            extra = [stack.enter_context(StandinServer()).port]
        elif mode == "raise-reset":
            extra = [0, tool_model_saved(tmp_path / "model", tool_tokenizer, tool_model_weights)]
        result = launch(tmp_path, mode, *extra, expect_failure=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(2)]
    want = "ResetFailed" if mode == "raise-reset" else "ZeroDivisionError"
    assert [r["caught"] for r in ranks] == [want, want]
    what = "FailingReset.reset" if mode == "raise-reset" else "rollout_func ('divides')"
    for rank in ranks:
        assert len(rank["notes"]) == 1 and what in rank["notes"][0]
        assert "in A-3PO's generation producer while playing the episodes of batch 0" in rank["notes"][0]
