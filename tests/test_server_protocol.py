"""The vLLM server backend against a stand-in server (loopback): failures are never silent, and the start-up probe
names what the server lacks before any weight moves. The real CPU server runs in tests/test_vllm_server.py."""

import re
import threading
import time
import warnings

import pytest
import torch
from testing_utils import COMMON, digit_reward, make_model, make_trainer

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout import ProducerError, vllm_probe, weight_transport
from trl_a3po.rollout import vllm_server as vllm_module
from trl_a3po.rollout.policy_weights import _hf_named_tensors
from trl_a3po.rollout.vllm_server import NCCLTransport, VLLMServerBackend, VLLMServerSetupError

from standin_server import StandinServer


def train_against(server, tmp_path, tokenizer, dataset, **kwargs):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        dataset,
        **{
            "rollout_backend": "vllm_server",
            "vllm_server_port": server.port,
            "weight_sync_transport": "disk",
            "max_steps": 2,
            **kwargs,
        },
    )
    trainer.train()
    return trainer


def test_a_well_behaved_standin_trains(tmp_path, tokenizer, prompt_dataset):
    # The control for the failure tests below: the stand-in itself is a server the trainer can train against.
    with StandinServer("ok") as server:
        trainer = train_against(server, tmp_path, tokenizer, prompt_dataset)
    assert trainer.state.global_step == 2
    assert server.paths.count("/v1/completions") == 2
    assert server.paths.index("/collective_rpc") < server.paths.index("/v1/completions")  # weights before text


def test_an_error_event_mid_stream_makes_train_raise_with_the_servers_message(tmp_path, tokenizer, prompt_dataset):
    # vLLM reports an engine failure inside the 200 stream, after some tokens: never training data.
    with StandinServer("error") as server, pytest.raises(ProducerError) as raised:
        train_against(server, tmp_path, tokenizer, prompt_dataset)
    assert StandinServer.ERROR_MESSAGE in str(raised.value)
    assert f"127.0.0.1:{server.port}" in str(raised.value) and "generating batch 0" in str(raised.value)


def test_a_server_that_restarted_between_push_and_generation_is_caught(tmp_path, tokenizer, prompt_dataset):
    # A restarted server holds its base weights again: its completions must never be trained under the pushed
    # version's label. The second batch's request finds the server "restarted" (its weight label gone).
    with StandinServer("ok", restart_at=2) as server, pytest.raises(ProducerError) as raised:
        train_against(server, tmp_path, tokenizer, prompt_dataset, max_steps=4)
    assert "holds weights labelled None, not the ones this run pushed" in str(raised.value)
    assert "generating batch 1" in str(raised.value)
    assert server.paths.count("/weight_info") == 1 + 2  # probed once, then read back after each generation


def test_a_row_without_finish_reason_is_refused(tmp_path, tokenizer, prompt_dataset):
    with (
        StandinServer("unfinished") as server,
        pytest.raises(ProducerError, match=r"finish_reason None after 2 tokens"),
    ):
        train_against(server, tmp_path, tokenizer, prompt_dataset)


def test_a_stalled_server_raises_within_vllm_server_timeout(tmp_path, tokenizer, prompt_dataset):
    with StandinServer("stall", stall_s=60) as server:
        start = time.monotonic()
        with pytest.raises(ProducerError, match=r"sent nothing for 2 s while generating .*vllm_server_timeout"):
            train_against(server, tmp_path, tokenizer, prompt_dataset, vllm_server_timeout=2.0)
        assert time.monotonic() - start < 20


@pytest.mark.parametrize(
    "server_kwargs,transport,message",
    [
        (
            dict(dev_mode=False),
            "disk",
            r"without VLLM_SERVER_DEV_MODE=1.*/collective_rpc.*`trl vllm-serve --model MODEL --host 127.0.0.1 "
            r"--port \d+` \(or, without TRL on the server's machine, `VLLM_SERVER_DEV_MODE=1 vllm "
            r"serve MODEL --host 127.0.0.1",
        ),
        (dict(dev_mode=False), "nccl", r"without VLLM_SERVER_DEV_MODE=1.*--weight-transfer-config"),
        (
            dict(logprobs_mode="raw_logprobs"),
            "disk",
            r"returns 'raw_logprobs' log-probs.*--logprobs-mode "
            r"processed_logprobs",
        ),
        (
            dict(weight_transfer=None),
            "nccl",
            r"no NCCL weight-transfer engine.*--weight-transfer-config "
            r"'\{\"backend\": \"nccl\"\}'",
        ),
        (
            dict(weight_transfer={"backend": "nccl"}, version="0.27.1"),
            "nccl",
            r"trainer's vLLM 0.31.0 and the server's 0.27.1 speak different NCCL weight-update formats.*"
            r"pip install vllm==0.27.1",
        ),
        # vLLM < 0.32 seeds every data-parallel replica alike: a prompt's copies would come back as one sample
        (
            dict(replicas=2, version="0.31.0"),
            "disk",
            r"runs 2 data-parallel replicas on vLLM 0.31.0, whose replicas seed their samplers alike.*"
            r"vLLM >= 0.32.*--data-parallel-size 1",
        ),
    ],
)
def test_the_start_up_probe_names_what_the_server_lacks(tmp_path, monkeypatch, server_kwargs, transport, message):
    monkeypatch.setattr(weight_transport, "trainer_vllm_version", lambda: "0.31.0")
    args = A3POConfig(
        output_dir=str(tmp_path), rollout_backend="vllm_server", weight_sync_transport=transport, **COMMON
    )
    with StandinServer(**server_kwargs) as server:
        args.vllm_server_port = server.port
        with pytest.raises(VLLMServerSetupError, match=message):
            VLLMServerBackend.from_config(args, eos_token_ids=[1])
        assert not any(p.startswith(("/collective_rpc", "/init_weight_transfer_engine")) for p in server.paths)


def test_an_interrupted_request_keeps_the_tokens_received_and_cuts_each_row_at_its_budget(tmp_path):
    # In-flight updates on the server: the stand-in streams 2 tokens per row (token 5, then 6 with finish "length").
    args = A3POConfig(
        output_dir=str(tmp_path),
        rollout_backend="vllm_server",
        weight_sync_transport="disk",
        **{**COMMON, "max_completion_length": 2},
    )
    stop = threading.Event()
    with StandinServer() as server:
        args.vllm_server_port = server.port
        backend = VLLMServerBackend.from_config(args, eos_token_ids=[1])
        # Interrupted at the first event (row 0's first token): that token is kept, every row is unfinished.
        ids, logprobs, unfinished = backend.generate_until([[3, 4], [3, 4, 4]], stop, lambda: True, [0, 0])
        assert ids == [[5], []] and logprobs == [[-0.5], []] and unfinished == [True, True]
        # Row 0 continues with 1 of its 2 tokens sampled: its budget is 1, so the second token the request streams
        # (asked for the largest budget, row 1's 2) is cut, as max_tokens would have; row 1 finishes by length.
        ids, logprobs, unfinished = backend.generate_until([[3, 4, 5], [3, 4, 4]], stop, lambda: False, [1, 0])
        assert ids == [[5], [5, 6]] and logprobs == [[-0.5], [-0.5, -0.5]] and unfinished == [False, False]
        backend.close()


def test_nccl_needs_vllm_beside_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_transport, "trainer_vllm_version", lambda: None)
    with StandinServer(weight_transfer={"backend": "nccl"}) as server:
        args = A3POConfig(
            output_dir=str(tmp_path),
            rollout_backend="vllm_server",
            vllm_server_port=server.port,
            weight_sync_transport="nccl",
            **COMMON,
        )
        with pytest.raises(VLLMServerSetupError, match=r"pip install 'trl-a3po\[vllm\]' \(vllm==0.31.0"):
            VLLMServerBackend.from_config(args, eos_token_ids=[1])


class PackedRecorder:
    """Stands in for TRL's VLLMClient after `init_communicator`: records each update's calls."""

    def __init__(self):
        self.updates, self.calls = [], []

    def weight_update(self):
        import contextlib

        @contextlib.contextmanager
        def update():
            self.calls.append("start")
            yield
            self.calls.append("finish")

        return update()

    def update_named_params(self, metadata, named_params):
        self.calls.append("update_named_params")
        items = list(named_params)
        assert [name for name, _ in items] == [m[0] for m in metadata]
        self.updates.append({name: tensor.clone() for name, tensor in items})

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def test_nccl_push_is_one_packed_update_with_every_tensor_once(tokenizer):
    model = make_model(tokenizer)  # tied embeddings: lm_head.weight is the embedding's storage
    transport = NCCLTransport(group_port=51299)
    transport.client = PackedRecorder()
    tensors = _hf_named_tensors(model)
    assert "lm_head.weight" in tensors
    transport.push(None, transport.stage(tensors))
    assert transport.client.calls == ["start", "update_named_params", "finish", "reset_prefix_cache"]
    (update,) = transport.client.updates
    assert "lm_head.weight" not in update  # the server ties it to the embedding itself
    assert sorted(update) == sorted(name for name, _ in model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(update[name], param.detach())


def test_server_fields_of_grpo_config_reach_the_nccl_client(tmp_path, monkeypatch):
    built = []
    original = NCCLTransport.__init__

    def recording(self, **kwargs):
        built.append(kwargs)
        original(self, **kwargs)

    monkeypatch.setattr(NCCLTransport, "__init__", recording)
    args = A3POConfig(
        output_dir=str(tmp_path),
        rollout_backend="vllm_server",
        weight_sync_transport="nccl",
        vllm_group_port=51300,
        vllm_server_timeout=17.0,
        **COMMON,
    )
    with StandinServer(dev_mode=False) as server:  # refused by the probe, after the transport is built
        args.vllm_server_port = server.port
        with pytest.raises(VLLMServerSetupError):
            VLLMServerBackend.from_config(args, eos_token_ids=[1])
    assert built == [{"group_port": 51300, "timeout_s": 17.0}]


def lora_trainer(server, tmp_path, tokenizer, dataset, lora_weight_sync, **lora_kwargs):
    from peft import LoraConfig

    args = A3POConfig(
        output_dir=str(tmp_path),
        rollout_backend="vllm_server",
        vllm_server_port=server.port,
        weight_sync_transport="disk",
        lora_weight_sync=lora_weight_sync,
        **{**COMMON, "max_steps": 2},
    )
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **lora_kwargs)
    return A3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=digit_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config,
    )


@pytest.mark.parametrize(
    "server_lora,lora_kwargs,reason",
    [
        (False, {}, r"lacks --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        (True, {"rank_pattern": {"q_proj": 8}}, r"has LoRA with a per-module rank_pattern"),
    ],
)
def test_auto_falls_back_to_merged_weights_with_the_reason_logged(
    tmp_path, tokenizer, prompt_dataset, caplog, server_lora, lora_kwargs, reason
):
    with StandinServer(lora=server_lora) as server, caplog.at_level("WARNING"):
        trainer = lora_trainer(server, tmp_path, tokenizer, prompt_dataset, "auto", **lora_kwargs)
        trainer.train()
    assert re.search(r"lora_weight_sync='auto': sending merged weights, .*" + reason, caplog.text), caplog.text
    assert not trainer._rollout.sends_adapter
    assert "/collective_rpc" in server.paths and "/v1/load_lora_adapter" not in server.paths


def test_auto_sends_the_adapter_where_the_server_serves_it(tmp_path, tokenizer, prompt_dataset):
    with StandinServer(lora=True) as server:
        trainer = lora_trainer(server, tmp_path, tokenizer, prompt_dataset, "auto")
        trainer.train()
    assert trainer._rollout.sends_adapter
    assert "/v1/load_lora_adapter" in server.paths and "/collective_rpc" not in server.paths


def test_adapter_sync_refuses_a_server_without_runtime_lora(tmp_path, tokenizer, prompt_dataset):
    with StandinServer(lora=False) as server:
        trainer = lora_trainer(server, tmp_path, tokenizer, prompt_dataset, "adapter")
        with pytest.raises(
            VLLMServerSetupError,
            match=r"cannot load LoRA adapters at run time. Restart it with "
            r"--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        ):
            trainer.train()
        assert trainer.state.global_step == 0


def test_adapter_sync_refuses_an_unservable_lora_before_any_model_work(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    from trl import GRPOTrainer

    def trl_init(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    with (
        StandinServer(lora=True) as server,
        pytest.raises(
            ValueError, match=r"lora_weight_sync='adapter' cannot serve LoRA with a per-module rank_pattern"
        ),
    ):
        lora_trainer(server, tmp_path, tokenizer, prompt_dataset, "adapter", rank_pattern={"q_proj": 8})


def test_the_probe_takes_a_data_parallel_server_from_032_and_warns_past_the_tested_releases(tmp_path):
    args = A3POConfig(output_dir=str(tmp_path), rollout_backend="vllm_server", weight_sync_transport="disk", **COMMON)
    with StandinServer(replicas=2, version="0.32.0") as server:
        args.vllm_server_port = server.port
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a tested release: nothing to warn about
            VLLMServerBackend.from_config(args, eos_token_ids=[1]).close()
    with StandinServer(version="0.34.0") as server:
        args.vllm_server_port = server.port
        with pytest.warns(UserWarning, match=r"runs vLLM 0.34.0; trl-a3po was tested with vLLM 0.31, 0.32"):
            VLLMServerBackend.from_config(args, eos_token_ids=[1]).close()


def test_a_data_parallel_replica_that_missed_a_push_stops_training_naming_it(tmp_path, tokenizer, prompt_dataset):
    # vLLM >= 0.32 reports each replica's checksums: after every push of merged weights they must agree.
    with StandinServer(replicas=2, version="0.32.0") as server:
        train_against(server, tmp_path / "agree", tokenizer, prompt_dataset)
        assert server.paths.count("/weight_checker") == server.pushes >= 1  # one comparison per push
    with StandinServer(replicas=2, version="0.32.0", replica_missing_pushes=1) as server:
        with pytest.raises(
            ProducerError,
            match=r"while loading version 0.*After push 1, the data-parallel replicas .* hold different weights "
            r"\(2 tensors differ, e.g. \['pp0:pcp0:tp0:model.embed_tokens.weight', 'pp0:pcp0:tp0:model.norm.weight'"
            r"\]; replicas reporting: \['dp0', 'dp1'\] of 2\): a replica missed the push",
        ):
            train_against(server, tmp_path / "missed", tokenizer, prompt_dataset)


def test_a_server_beyond_loopback_with_open_dev_routes_is_named_once(tmp_path, monkeypatch, caplog):
    # vLLM checks an API key on /v1, /v2, /inference and /cohere only: with dev mode, its weight and RPC routes answer
    # anyone. Reached at an address other than loopback, the probe says so once, and how to close it.
    assert vllm_probe._is_loopback("127.0.0.1") and vllm_probe._is_loopback("localhost")
    assert not vllm_probe._is_loopback("10.1.2.3") and not vllm_probe._is_loopback("no-such-host.invalid")
    for beyond_loopback in (False, True):
        monkeypatch.setattr(vllm_probe, "_is_loopback", lambda host: not beyond_loopback)
        caplog.clear()
        with StandinServer("ok") as server, caplog.at_level("WARNING", logger="trl_a3po.rollout.vllm_server"):
            transport = vllm_module.DiskTransport(str(tmp_path / "sync"))
            VLLMServerBackend(f"http://127.0.0.1:{server.port}", transport, {}).close()
        opened = [r.getMessage() for r in caplog.records if "development routes without an API key" in r.getMessage()]
        assert len(opened) == (1 if beyond_loopback else 0)
    assert "/collective_rpc" in opened[0] and "Bind it to a private interface (`--host`)" in opened[0]
