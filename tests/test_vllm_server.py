"""The vLLM server backend against a real `vllm serve` (CPU build), started by the fixture on loopback."""

import collections
import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from testing_utils import (
    COMMON,
    check_behaviour_logprobs_against_versions,
    check_ranks_follow_the_synchronous_shards,
    digit_reward,
    free_port,
    generate_two_versions_ahead,
    launch,
    logged,
    make_tokenizer,
    producer_threads,
    record_versions_and_samples,
    require_deepspeed,
    vllm_python,
    wait_for_the_next_version,
)
from transformers import AutoModelForCausalLM, Qwen2Config, TrainerCallback

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout import GenerationQueue, ProducerError
from trl_a3po.rollout.policy_weights import policy_tensors
from trl_a3po.rollout.vllm_server import VLLMServerBackend, VLLMServerSetupError

from local_vllm import local_vllm_server


REPO = Path(__file__).resolve().parent.parent


def make_server_model(tokenizer):
    # vLLM's CPU attention needs a supported head size (32 here): a little wider than the other tests' model.
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    python = vllm_python()
    if python is None:
        if os.environ.get("A3PO_REQUIRE_VLLM"):
            pytest.fail("A3PO_REQUIRE_VLLM is set but no vLLM venv was found (.venv-vllm or A3PO_VLLM_PYTHON)")
        pytest.skip("no vLLM venv (.ci/run installs one in .venv-vllm)")
    root = tmp_path_factory.mktemp("vllm")
    model_dir = root / "model"
    tokenizer = make_tokenizer()
    make_server_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = free_port()
    # Started as a TRL user starts it: `trl vllm-serve` (the NCCL weight-transfer engine is configured; it is only
    # opened by /init_weight_transfer_engine, which no test here calls).
    with local_vllm_server(
        python,
        str(model_dir),
        port,
        str(root),
        max_model_len=512,
        timeout_s=300,
        env={"HF_HUB_OFFLINE": "1"},
    ):
        yield {"port": port, "model_dir": model_dir, "tokenizer": tokenizer, "log": root / "server.log"}


@contextlib.contextmanager
def another_server(vllm_server, env: dict, extra_args: tuple, port: int | None = None, **server_kwargs):
    """Another `trl vllm-serve` of the same model (on `port`, else a free one), with `env` and `extra_args` on top of
    the shared ones (`server_kwargs`: `local_vllm_server`'s other options)."""
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="vllm-", dir="/tmp"))  # engine sockets: a short path
    with local_vllm_server(
        vllm_python(),
        str(vllm_server["model_dir"]),
        port,
        str(workdir),
        max_model_len=512,
        timeout_s=300,
        env={"HF_HUB_OFFLINE": "1", **env},
        extra_args=extra_args,
        **server_kwargs,
    ):
        yield {**vllm_server, "port": port, "log": workdir / "server.log"}
    shutil.rmtree(workdir, ignore_errors=True)


LORA_SERVER = (
    {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
)


@pytest.fixture(scope="module")
def vllm_lora_server(vllm_server):
    """A second server of the same model that loads LoRA adapters at run time (lora_weight_sync='adapter')."""
    with another_server(vllm_server, *LORA_SERVER) as server:
        yield server


def data_parallel_server(vllm_server, lora: bool):
    """`trl vllm-serve --data_parallel_size 2` (how TRL's docs scale generation on one node): two engine replicas
    behind vLLM's API server(s), which balance requests between them. With `lora`, adapters loadable at run time, which
    vLLM allows behind one API server only (its default is one per replica)."""
    env, extra_args = LORA_SERVER if lora else ({}, ())
    extra_args = ("--data_parallel_size", "2", *(("--api-server-count", "1") if lora else ()), *extra_args)
    return another_server(vllm_server, env, extra_args)


def requests_finished_per_replica(server) -> collections.Counter:
    """vLLM's Prometheus counters: the requests each data-parallel engine (replica) has finished, by its index."""
    text = requests.get(f"http://127.0.0.1:{server['port']}/metrics", timeout=10).text
    finished = collections.Counter()
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            finished[re.search(r'engine="(\d+)"', line).group(1)] += float(line.rsplit(" ", 1)[1])
    return finished


def make_trainer(tmp_path, server, prompt_dataset, peft_config=None, **kwargs):
    # A TRL user's vLLM config, as it is: generated ahead on their server
    args = A3POConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_port=server["port"],
        **{**COMMON, **kwargs},
    )
    model = AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32)
    return A3POTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=server["tokenizer"],
        peft_config=peft_config,
    )


def server_vs_trainer_logprob_error(backend, trainer, prompt):
    completion_ids, logprobs_list = backend.generate([prompt] * 4, threading.Event())
    errors = []
    for completion, logprobs in zip(completion_ids, logprobs_list):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / trainer.args.temperature
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        errors.append((expected - torch.tensor(logprobs)).abs().max().item())
    return max(errors)


def test_a_server_that_cannot_start_leaves_no_socket_folder(tmp_path, monkeypatch):
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def recorded_mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded_mkdtemp)
    with pytest.raises(FileNotFoundError):
        with local_vllm_server(str(tmp_path / "no-venv" / "bin" / "python"), "model", free_port(), str(tmp_path)):
            pass
    assert len(made) == 1 and made[0].startswith("/tmp/vllm-rpc-")
    assert not os.path.exists(made[0])


def test_disk_sync_makes_the_server_match_the_trainers_weights(tmp_path, vllm_server, prompt_dataset):
    trainer = make_trainer(tmp_path, vllm_server, prompt_dataset)
    backend = VLLMServerBackend.from_config(trainer.args, list(trainer.eos_token_ids))
    prompt = vllm_server["tokenizer"]("Question 7: what is 7 plus 8?").input_ids
    trainer.model.eval()
    with torch.no_grad():  # the trainer moves away from the weights the server started with
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert server_vs_trainer_logprob_error(backend, trainer, prompt) > 1e-2  # the server still has the old weights
    with policy_tensors(trainer.model_wrapped, trainer._dist) as tensors:
        seconds = backend.load(backend.stage(tensors))
    assert seconds > 0
    assert server_vs_trainer_logprob_error(backend, trainer, prompt) < 1e-4
    backend.close()


@pytest.mark.parametrize("inflight,continuous", [(False, False), (True, False), (False, True), (True, True)])
def test_async_training_on_the_vllm_server_respects_the_bound(
    tmp_path, vllm_server, prompt_dataset, inflight, continuous, monkeypatch
):
    # in-flight: requests aborted mid-sequence, the version pushed, the rest resubmitted
    if inflight:
        monkeypatch.setattr(GenerationQueue, "_newer_version_due", wait_for_the_next_version)
    streams = {"now": 0, "most": 0, "first": True}
    if continuous:  # count the requests streaming at once
        changed, generate_until = threading.Condition(), VLLMServerBackend.generate_until

        def counted(backend, *args):
            with changed:
                streams["now"] += 1
                streams["most"] = max(streams["most"], streams["now"])
                changed.notify_all()
                # The first stream waits for a second to start (the first submission admits batches 0-2 at once,
                # and the coordinator streams every one of them): a tiny request could otherwise end before the next
                # thread starts. Streams started one after another never meet, and the assertion below fails.
                first, streams["first"] = streams["first"], False
                if first:
                    changed.wait_for(lambda: streams["now"] >= 2, timeout=60)
            try:
                return generate_until(backend, *args)
            finally:
                with changed:
                    streams["now"] -= 1

        monkeypatch.setattr(VLLMServerBackend, "generate_until", counted)
    trainer = make_trainer(
        tmp_path,
        vllm_server,
        prompt_dataset,
        steps_per_generation=2,
        max_steps=8,
        weight_sync_transport="disk",
        max_staleness=2,
        learning_rate=1e-2,
        inflight_weight_updates=inflight,
        continuous_generation=continuous,
    )
    versions, samples = record_versions_and_samples(trainer)
    before = weight_pushes_logged(vllm_server)
    trainer.train()
    staleness = logged(trainer, "a3po/staleness/max")
    assert len(staleness) == 8 and max(staleness) <= trainer.args.max_staleness == 2
    assert trainer.args.rollout_backend == "vllm_server" and not trainer.args.use_vllm  # TRL's client not built
    if not (inflight or continuous):  # the generator runs ahead to the bound (A-3PO's alpha 1/2 engages)
        assert max(staleness) == 2
    # The version invariant: every sample's behaviour log-probs are those of the weights of its recorded version
    # (server-side sampling vs a trainer forward: float32 on both sides, different kernels).
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 8 * 4
    # a push happens exactly when the producer moves to a newer version: once per distinct behaviour version
    behaviour_versions = {int(v) for inputs in samples for v in inputs["behavior_version"].unique()}
    assert weight_pushes_logged(vllm_server) - before == len(behaviour_versions) >= 2
    if inflight:
        assert max(logged(trainer, "a3po/gen/mixed_version_frac")) > 0
    if continuous:  # several generation batches streamed at once
        assert streams["most"] >= 2
    # at staleness <= 1 the proximal policy is the behaviour policy: weight exactly 1
    for d, w_min, w_max in zip(
        staleness, logged(trainer, "a3po/behav_imp_weight/min"), logged(trainer, "a3po/behav_imp_weight/max")
    ):
        if d <= 1:
            assert w_min == pytest.approx(1.0) and w_max == pytest.approx(1.0)
    assert producer_threads() == []  # no thread left behind


def test_greedy_eval_on_the_vllm_server_matches_hf_generate(vllm_server, tmp_path):
    from trl_a3po import gsm8k_accuracy_reward, gsm8k_greedy_accuracy, load_gsm8k
    from trl_a3po.evaluation import _render, generate_greedy_hf, generate_greedy_vllm
    from trl_a3po.rollout.vllm_server import DiskTransport

    url = f"http://127.0.0.1:{vllm_server['port']}"
    tokenizer = vllm_server["tokenizer"]
    model = AutoModelForCausalLM.from_pretrained(vllm_server["model_dir"], dtype=torch.float32).eval()
    # earlier tests trained the server's weights: put the folder's weights back first
    backend = VLLMServerBackend(url, DiskTransport(str(tmp_path)), sampling={})
    backend.load(backend.stage(model.state_dict()))
    dataset = load_gsm8k(str(REPO / "recipes" / "data" / "gsm8k"), "test", limit=4)
    result = gsm8k_greedy_accuracy(
        dataset, tokenizer, vllm_base_url=url, batch_size=2, max_new_tokens=8, progress=False
    )
    prompt_ids = _render(tokenizer, dataset["prompt"])
    texts = generate_greedy_hf(model, tokenizer, prompt_ids, 8)
    assert generate_greedy_vllm(url, prompt_ids, 8) == texts
    expected = sum(gsm8k_accuracy_reward(texts, dataset["answer"])) / 4
    assert result["total"] == 4 and result["accuracy"] == expected
    backend.close()


def weight_pushes_logged(server):
    """The server's access log: one `reload_weights` RPC per disk push."""
    return server["log"].read_text().count('"POST /collective_rpc HTTP/1.1" 200')


# (LoRA with merged weights across two processes: the adapter test below covers two processes with LoRA, and the
# merged export is tested in one process, tests/test_async.py, to keep CI within its time.)
# (In-flight updates alone on one server with two processes: the continuous + in-flight case covers both at once, to
# keep CI within its time; one process runs each separately, in the test above.)
@pytest.mark.parametrize("mode", ["vllm", "vllm-zero3", "vllm-continuous-inflight"])
def test_two_processes_share_one_server_with_one_push_per_version(tmp_path, vllm_server, synchronous_shards, mode):
    # The production shape: several training processes, one vLLM server. The main process owns the server's weights
    # and generates every rank's share; each rank trains exactly its synchronous share. With LoRA, the server gets
    # the merged weights of each version. Under real DeepSpeed ZeRO-3 (CPU, gloo) every process enters the gather at
    # each version and the main process pushes the whole weights.
    if mode == "vllm-zero3":
        require_deepspeed()
    sync = synchronous_shards
    before = weight_pushes_logged(vllm_server)
    ranks = launch(tmp_path, mode, vllm_server["port"], vllm_server["model_dir"])
    pushes = weight_pushes_logged(vllm_server) - before
    check_ranks_follow_the_synchronous_shards(sync, ranks)
    for rank in range(2):
        assert ranks[rank]["checked"] == 16  # every sample against the weights of its recorded version
    versions = sorted(set(ranks[0]["behaviour_versions"]) | set(ranks[1]["behaviour_versions"]))
    assert len(versions) >= 2
    assert pushes == len(versions)  # one push per version the generator used, not one per rank
    if mode == "vllm-zero3":
        assert ranks[0]["partitioned_fraction"] == ranks[1]["partitioned_fraction"] == 0.5
    if mode.endswith("-inflight"):  # requests aborted mid-sequence, weights pushed, the rest resubmitted
        assert ranks[0]["mixed"] + ranks[1]["mixed"] > 0


def test_two_processes_share_one_server_on_an_iterable_dataset(tmp_path, vllm_server, synchronous_iterable_shards):
    # The main process reads both processes' shards of the stream (Accelerate's sharding, for each process index)
    # and generates them on the server; each process trains its synchronous share.
    ranks = launch(tmp_path, "vllm-iterable", vllm_server["port"], vllm_server["model_dir"])
    check_ranks_follow_the_synchronous_shards(synchronous_iterable_shards, ranks)
    assert [r["checked"] for r in ranks] == [16, 16]


def test_nccl_transport_has_one_communicator_and_one_packed_push_per_version(tmp_path, vllm_server):
    # NCCL needs GPUs: TRL's client is replaced by a recorder; generation and the start-up probe run on the real
    # server (started with the weight-transfer flag the probe checks).
    ranks = launch(tmp_path, "vllm-nccl-standin", vllm_server["port"], vllm_server["model_dir"])
    main, other = ranks[0]["client_calls"], ranks[1]["client_calls"]
    versions = set(ranks[0]["behaviour_versions"]) | set(ranks[1]["behaviour_versions"])
    assert main["init_communicator"] == 1 and main["close_communicator"] == 1
    assert ranks[0]["group_ports"] == [51277]  # GRPOConfig's vllm_group_port reaches TRL's client
    # one packed update per version the generator used, each with every tensor once (the tied lm_head not sent)
    assert main["weight_updates"] == main["update_named_params"] == main["reset_prefix_cache"] == len(versions) >= 2
    for names in ranks[0]["client_updates"]:
        assert sorted(names) == ranks[0]["parameter_names"] and "lm_head.weight" not in names
    assert other == {key: 0 for key in other}  # the other rank never talks to the server's weights


def test_a_real_server_without_dev_mode_is_refused_before_the_first_step(tmp_path, vllm_server, prompt_dataset):
    # The README's server command once lacked VLLM_SERVER_DEV_MODE=1: the probe refuses such a server at the first
    # generation batch, naming the variable and the command, before any optimizer step or weight push.
    with another_server(vllm_server, {}, (), dev_mode=False, launcher="vllm") as server:
        trainer = make_trainer(tmp_path, server, prompt_dataset, max_steps=2, weight_sync_transport="disk")
        with pytest.raises(
            VLLMServerSetupError,
            match=r"started without VLLM_SERVER_DEV_MODE=1.*Restart it with "
            r"VLLM_SERVER_DEV_MODE=1 in its environment.*`trl vllm-serve --model MODEL --host 127.0.0.1",
        ):
            trainer.train()
        assert trainer.state.global_step == 0
        log = server["log"].read_text()
    assert '"GET /server_info?config_format=json HTTP/1.1" 404' in log
    assert "POST /collective_rpc" not in log and "POST /v1/completions" not in log


def test_a_server_started_with_an_api_key_trains_with_vllm_api_key(tmp_path, vllm_server, prompt_dataset, monkeypatch):
    # `trl vllm-serve ... --api-key KEY` (how shared clusters run it): without VLLM_API_KEY, or with another key, the
    # probe names the variable before any step or push; with it, a TRL user's server config trains, every token
    # checked against its recorded version.
    key = "a3po-test-key"
    with another_server(vllm_server, {}, ("--api-key", key)) as server:
        for env_key, refusal in ((None, r"wants an API key .*set VLLM_API_KEY"), ("other", r"refused the API key")):
            if env_key is None:
                monkeypatch.delenv("VLLM_API_KEY", raising=False)
            else:
                monkeypatch.setenv("VLLM_API_KEY", env_key)
            trainer = make_trainer(tmp_path / str(env_key), server, prompt_dataset, weight_sync_transport="disk")
            with pytest.raises(VLLMServerSetupError, match=refusal):
                trainer.train()
            assert trainer.state.global_step == 0
        monkeypatch.setenv("VLLM_API_KEY", key)
        trainer = make_trainer(
            tmp_path / "key",
            server,
            prompt_dataset,
            steps_per_generation=2,
            max_steps=4,
            weight_sync_transport="disk",
            max_staleness=1,
            learning_rate=1e-2,
        )
        versions, samples = record_versions_and_samples(trainer)
        trainer.train()
        assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 4 * 4
        # vLLM guards /v1 with the key, not its development routes (the warning for servers beyond loopback)
        url = f"http://127.0.0.1:{server['port']}"
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{url}/server_info", timeout=10).status_code == 200
        log = server["log"].read_text()
    assert log.count('"GET /v1/models HTTP/1.1" 401') >= 3 and '"GET /v1/models HTTP/1.1" 200' in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log and '"POST /v1/completions HTTP/1.1" 401' not in log


def kill_server_group(port: int) -> None:
    """SIGKILL a local_vllm_server's whole process group (API server, engine core), found by its port."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # `trl vllm-serve` runs vllm.entrypoints.cli.main; launcher="vllm" runs vllm.entrypoints.openai.api_server
        if any(part.startswith(b"vllm.entrypoints.") for part in cmdline) and str(port).encode() in cmdline:
            os.killpg(int(pid), signal.SIGKILL)  # the server leads its own session: its pgid is its pid


def adapter_traffic(log: str) -> dict:
    """From a server's access log: adapters loaded, the most registered at once, and base-weight reloads."""
    registered = most = loads = 0
    for line in log.splitlines():
        if '"POST /v1/load_lora_adapter HTTP/1.1" 200' in line:
            loads += 1
            registered += 1
            most = max(most, registered)
        elif '"POST /v1/unload_lora_adapter HTTP/1.1" 200' in line:
            registered -= 1
    return {"loads": loads, "most_at_once": most, "base_reloads": log.count("POST /collective_rpc")}


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def test_lora_adapter_sync_loads_one_adapter_per_version_and_never_the_base_weights(
    tmp_path, vllm_lora_server, prompt_dataset
):
    from peft import LoraConfig

    server = vllm_lora_server
    before = adapter_traffic(server["log"].read_text())
    args = A3POConfig(
        output_dir=str(tmp_path),
        rollout_backend="vllm_server",
        vllm_server_port=server["port"],
        lora_weight_sync="adapter",
        weight_sync_transport="disk",
        **{**COMMON, "steps_per_generation": 2, "max_steps": 8, "max_staleness": 2, "learning_rate": 1e-2},
    )
    model = AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32)
    trainer = A3POTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=server["tokenizer"],
        peft_config=LoraConfig(**LORA),
    )
    versions, samples = record_versions_and_samples(trainer)
    trainer.train()
    traffic = adapter_traffic(server["log"].read_text())
    behaviour_versions = {int(v) for inputs in samples for v in inputs["behavior_version"].unique()}
    assert len(behaviour_versions) >= 2
    assert traffic["loads"] - before["loads"] == len(behaviour_versions)  # one adapter per version used
    assert traffic["base_reloads"] == before["base_reloads"] == 0  # the base weights never move
    assert traffic["most_at_once"] <= args.max_staleness + 2
    # every sample's behaviour log-probs = base model + the adapter of its recorded version
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 8 * 4
    assert trainer._rollout.sends_adapter


def test_two_processes_share_a_lora_server_with_one_adapter_per_version(
    tmp_path, vllm_lora_server, synchronous_shards
):
    server = vllm_lora_server
    before = adapter_traffic(server["log"].read_text())
    ranks = launch(tmp_path, "vllm-lora-adapter", server["port"], server["model_dir"])
    traffic = adapter_traffic(server["log"].read_text())
    check_ranks_follow_the_synchronous_shards(synchronous_shards, ranks)
    for rank in range(2):
        assert ranks[rank]["checked"] == 16  # every sample against base + its version's adapter
    versions = set(ranks[0]["behaviour_versions"]) | set(ranks[1]["behaviour_versions"])
    assert traffic["loads"] - before["loads"] == len(versions) >= 2
    assert traffic["base_reloads"] == 0 and traffic["most_at_once"] <= 2 + 2


@pytest.mark.parametrize(
    "case",
    [
        dict(loss_type="grpo", importance_sampling_level="sequence"),  # GSPO
        dict(loss_type="cispo"),
    ],
    ids=["gspo", "cispo"],
)
def test_gspo_and_cispo_train_asynchronously_on_the_vllm_server(tmp_path, vllm_server, prompt_dataset, case):
    trainer = make_trainer(
        tmp_path, vllm_server, prompt_dataset, max_steps=8, weight_sync_transport="disk", learning_rate=1e-2, **case
    )
    generate_two_versions_ahead(trainer)
    versions, samples = record_versions_and_samples(trainer)
    trainer.train()
    assert logged(trainer, "a3po/staleness/max") == [0, 1] + [2] * 6
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 8 * 4
    clip_key = "cispo_clip_ratio" if case["loss_type"] == "cispo" else "clip_ratio/region_mean"
    assert len(logged(trainer, clip_key)) == 8
    assert producer_threads() == []


def test_a_cooled_sampler_on_the_vllm_server_reports_the_cooled_logprobs(tmp_path, vllm_server, prompt_dataset):
    trainer = make_trainer(
        tmp_path,
        vllm_server,
        prompt_dataset,
        max_steps=6,
        weight_sync_transport="disk",
        learning_rate=1e-2,
        temperature=1.0,
        sampling_temperature=0.7,
    )
    generate_two_versions_ahead(trainer)
    versions, samples = record_versions_and_samples(trainer)
    trainer.train()
    assert logged(trainer, "a3po/staleness/max") == [0, 1] + [2] * 4
    # the behaviour policy: each recorded version's weights at the sampler's temperature
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3, temperature=0.7) == 6 * 4


# The two tests below kill the module's servers (a server start costs ~50 s here, so they reuse them): they run last,
# in this order (pytest keeps the file's order), after every other user of those servers.


def test_a_server_killed_mid_run_stops_training_naming_it(tmp_path, vllm_lora_server, prompt_dataset):
    # The real CPU server (the LoRA-enabled one; this policy sends merged weights), SIGKILLed (process group) after
    # the first optimizer step while the producer generates ahead: train() raises within 60 s, naming the server.
    server = vllm_lora_server
    port = server["port"]

    class KillAfterFirstStep(TrainerCallback):
        killed_at = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                kill_server_group(port)
                KillAfterFirstStep.killed_at = time.monotonic()

    trainer = make_trainer(
        tmp_path,
        server,
        prompt_dataset,
        max_steps=6,
        steps_per_generation=1,
        max_staleness=2,
        weight_sync_transport="disk",
        vllm_server_timeout=30.0,
    )
    trainer.add_callback(KillAfterFirstStep())
    with pytest.raises(ProducerError, match=rf"vLLM server at 127.0.0.1:{port} went away"):
        trainer.train()
    detected_s = time.monotonic() - KillAfterFirstStep.killed_at
    print(f"killed server detected {detected_s:.1f} s after the kill")  # docs/reliability.md (pytest -s)
    assert detected_s < 60
    # Nothing generated after the kill is trained: at the kill (end of step 1) batches up to 1 + max_staleness may
    # already be generated, and train; the next one would need the server.
    assert trainer.state.global_step <= 1 + trainer.args.max_staleness + 1


def test_a_server_restarted_mid_run_never_trains_a_mislabelled_sample(tmp_path, vllm_server, prompt_dataset):
    # The real CPU server killed and restarted on the same port after step 1 (base weights again). Whatever the
    # producer was doing then, one of two things may happen, never a third: it pushes a newer version to the restarted
    # server before generating (its log shows a reload before any completion) and every trained sample matches its
    # recorded version; or training stops with a ProducerError naming the server (gone, or holding weights this run
    # did not push). The module's main server is the one killed; its restart runs in a folder of its own.
    port = vllm_server["port"]
    restarted, restart = contextlib.ExitStack(), {}

    class RestartAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                kill_server_group(port)
                restart.update(restarted.enter_context(another_server(vllm_server, {}, (), port=port)))

    with restarted:
        trainer = make_trainer(
            tmp_path,
            vllm_server,
            prompt_dataset,
            max_steps=5,
            steps_per_generation=1,
            max_staleness=2,
            weight_sync_transport="disk",
            learning_rate=1e-2,
        )
        versions, samples = record_versions_and_samples(trainer)
        trainer.add_callback(RestartAfterFirstStep())
        try:
            trainer.train()
            failure = None
        except ProducerError as error:
            failure = str(error)
        log = restart["log"].read_text()
    print(f"restart outcome: {failure or 'recovered: a push before the first completion'}")  # pytest -s
    if failure is None:
        assert trainer.state.global_step == 5
        assert log.index("POST /collective_rpc") < log.index("POST /v1/completions")
        assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 5 * 4
    else:
        assert f"127.0.0.1:{port}" in failure
        assert "went away" in failure or "holds weights labelled" in failure, failure


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_every_replica_of_a_data_parallel_server_serves_the_pushed_version(
    tmp_path, vllm_server, prompt_dataset, sync
):
    # One push per version reaches both replicas (vLLM sends the reload, or the adapter, to every engine): every
    # trained token's behaviour log-prob is its recorded version's, while both replicas answered rows after the
    # weights had moved; the replicas' samplers are seeded apart, so no two samples of a prompt are one sample twice.
    with data_parallel_server(vllm_server, lora=sync == "adapter") as server:
        check_every_replica_serves_the_pushed_version(tmp_path, server, prompt_dataset, sync)


def check_every_replica_serves_the_pushed_version(tmp_path, server, prompt_dataset, sync):
    from peft import LoraConfig

    trainer = make_trainer(
        tmp_path,
        server,
        prompt_dataset,
        steps_per_generation=2,
        max_steps=16,  # 8 versions (2 optimizer steps each)
        max_completion_length=16,
        weight_sync_transport="disk",
        learning_rate=1e-2,
        lora_weight_sync=sync,
        peft_config=LoraConfig(**LORA) if sync == "adapter" else None,
    )
    release = requests.get(f"http://127.0.0.1:{server['port']}/version", timeout=10).json()["version"]
    if tuple(int(part) for part in release.split(".")[:2]) < (0, 32):  # (scripts/test_vllm_release.sh 0.31.0)
        with pytest.raises(VLLMServerSetupError, match=r"2 data-parallel replicas .* seed their samplers alike"):
            trainer.train()
        return
    versions, samples = record_versions_and_samples(trainer)
    finished = {}

    class CountAfterTheFirstVersions(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:  # version 0 trained: the batches submitted from here on are version 1+
                finished["before"] = requests_finished_per_replica(server)

    trainer.add_callback(CountAfterTheFirstVersions())
    pushes_before, adapters_before = weight_pushes_logged(server), adapter_traffic(server["log"].read_text())
    trainer.train()
    served = requests_finished_per_replica(server) - finished["before"]
    assert sorted(served) == ["0", "1"] and min(served.values()) > 0, served  # both replicas answered rows
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 16 * 4
    behaviour_versions = {int(v) for inputs in samples for v in inputs["behavior_version"].unique()}
    assert len(behaviour_versions) >= 4
    if sync == "adapter":  # one adapter load per version, the base weights never reloaded
        traffic = adapter_traffic(server["log"].read_text())
        assert traffic["loads"] - adapters_before["loads"] == len(behaviour_versions)
        assert traffic["base_reloads"] == adapters_before["base_reloads"]
        assert trainer._rollout.sends_adapter
    else:  # one reload per version, from the one backend, whatever the number of replicas
        assert weight_pushes_logged(server) - pushes_before == len(behaviour_versions)
    groups = collections.defaultdict(list)  # each prompt's num_generations samples (16 of 24 prompts)
    for inputs in samples:
        for prompt, ids, mask in zip(inputs["prompt_ids"], inputs["completion_ids"], inputs["completion_mask"]):
            groups[tuple(prompt.tolist())].append(tuple(ids[mask.bool()].tolist()))
    assert len(groups) == 16 and all(len(set(group)) == len(group) == 4 for group in groups.values())
