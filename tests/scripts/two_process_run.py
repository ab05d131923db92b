"""Run by tests/test_accelerate.py under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo): 8 optimizer
steps on a tiny model; each rank writes OUT_DIR/<mode>-rank<r>.json with the prompts it scored, the logged staleness,
its samples' behaviour versions, and how many samples it checked against the weights of their recorded version.

    two_process_run.py OUT_DIR sync|async                       in-process generation (async: a producer per rank)
    two_process_run.py OUT_DIR vllm|vllm-lora|vllm-lora-adapter|vllm-zero3|vllm-nccl-standin PORT MODEL_DIR
                                                                 one vLLM server for both ranks
    two_process_run.py OUT_DIR standin|standin-stagefail PORT   a stand-in server set up to fail (the run fails)

A `-iterable` suffix on sync, async and vllm runs streams the dataset (`IterableDataset`, 2 shards).

    two_process_run.py OUT_DIR sync-tools|vllm-tools|vllm-env PORT MODEL_DIR
                                                                 tool calls (TRL's `tools`, or an environment_factory)
                                                                 with the tool model saved in MODEL_DIR

`*-inflight` modes turn on in-flight weight updates so that versions are published mid-sequence: a generation of
batches ahead of the trainer waits, at each token, for the next version (testing_utils' `wait_for_the_next_version`);
`*-continuous-inflight` also
generates every admitted batch at once (continuous_generation: in-process merged into one `generate`, on the server
as concurrent requests).

`raise-rollout-func` (in-process: a producer per rank), `standin-raise-rollout-func PORT` (the main process generates
for both, on a stand-in server) and `raise-reset PORT MODEL_DIR` (an environment, in-process) run user code that
raises in the producer: each rank writes OUT_DIR/<mode>-rank<r>.json with the type `train()` raised and its notes.

`async-replay` records its batches (`record_generation_batches`), then replays them with the recorded anchor
(`ReplayTrainer`) in the same processes: each rank reports both runs' losses and whether the final weights match.

`vllm-nccl-standin` replaces TRL's VLLMClient (the NCCL weight transfer, which needs GPUs) with a recorder, to count
who initialises a communicator and how many pushes reach it; generation still runs on the real server.
"""

import json
import os
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ for testing_utils

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from testing_utils import (  # noqa: E402
    AddingEnvironment,
    VersionRecorder,
    add,
    check_behaviour_logprobs_against_versions,
    digit_reward,
    make_model,
    make_tokenizer,
    record_trained_samples,
    tool_question,
    wait_for_the_next_version,
)

from trl_a3po import A3POConfig, A3POTrainer  # noqa: E402
from trl_a3po.rollout import GenerationQueue  # noqa: E402


def model_tokens(sample):
    mask = sample["completion_mask"].bool()
    return mask & sample["tool_mask"].bool() if "tool_mask" in sample else mask


class ResetFailed(Exception):
    """The user's own exception type (an environment's reset raises it)."""


class FailingReset(AddingEnvironment):
    def reset(self, **row):
        raise ResetFailed("the environment has no task for this row")


def divides(prompts, trainer):  # a rollout_func with a bug
    return 1 / len(prompts[:0])


out_dir, run_name = Path(sys.argv[1]), sys.argv[2]
mode = run_name.removesuffix("-iterable")  # `*-iterable`: the same run on the dataset streamed (IterableDataset)
inflight = mode.endswith("-inflight")
agentic = mode.endswith(("-tools", "-env", "-reset"))
seen = []

if inflight:
    GenerationQueue._newer_version_due = wait_for_the_next_version


def recorded_reward(prompts, completions, **kwargs):
    if agentic:  # conversational: the last message's text, and the number of messages (turns and tool results)
        seen.append([p[-1]["content"] for p in prompts])
        return [len(c) + len(c[-1].get("content") or "") / 100 for c in completions]
    seen.append(list(prompts))
    return digit_reward(completions)


class RecordingClient:
    """Stands in for trl.generation.vllm_client.VLLMClient: records the calls NCCLTransport makes, and the names of
    the tensors each packed update carries."""

    calls = {
        "init_communicator": 0,
        "weight_updates": 0,
        "update_named_params": 0,
        "reset_prefix_cache": 0,
        "close_communicator": 0,
    }
    group_ports, updates = [], []

    def __init__(self, base_url, group_port, connection_timeout):
        self.group_ports.append(group_port)

    def init_communicator(self, device):
        self.calls["init_communicator"] += 1

    def weight_update(self):
        import contextlib

        self.calls["weight_updates"] += 1
        return contextlib.nullcontext()

    def update_named_params(self, metadata, named_params):
        self.calls["update_named_params"] += 1
        self.updates.append([name for name, _ in named_params])

    def reset_prefix_cache(self):
        self.calls["reset_prefix_cache"] += 1

    def close_communicator(self):
        self.calls["close_communicator"] += 1


tokenizer = make_tokenizer()
dataset = Dataset.from_dict({"prompt": [f"Question {i}: what is {i} plus {i + 1}?" for i in range(48)]})
server = {}
zero3 = mode.endswith("zero3")  # launched with DeepSpeed ZeRO-3 (tests/scripts/deepspeed_cpu.json)
if mode.startswith("standin"):  # a stand-in server (tests/standin_server.py) set up to fail; the run must fail
    server = dict(
        rollout_backend="vllm_server",
        vllm_server_port=int(sys.argv[3]),
        weight_sync_transport="disk",
        weight_sync_dir=str(out_dir / "weight_sync"),
        vllm_server_timeout=3.0,
    )
    model = make_model(make_tokenizer())
    if mode == "standin-stagefail":  # the main process fails while staging a version (its main thread)
        from trl_a3po.rollout.vllm_server import VLLMServerBackend

        def failing_stage(self, tensors):
            raise RuntimeError("staging failed (injected)")

        VLLMServerBackend.stage = failing_stage
elif agentic:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port, model_dir = int(sys.argv[3]), sys.argv[4]
    # float64 in the trainer (and the in-process generator): long episodes (conftest's `tool_model`)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": [tool_question(i) for i in range(48)]})
    if mode.startswith("vllm"):
        server = dict(
            use_vllm=True,  # a TRL user's vLLM config: generated ahead on the server
            vllm_mode="server",
            vllm_server_port=port,
            weight_sync_transport="disk",
            weight_sync_dir=str(out_dir / "weight_sync"),
        )
elif mode.startswith("vllm"):
    from transformers import AutoModelForCausalLM

    port, model_dir = int(sys.argv[3]), sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    server = dict(
        use_vllm=True,  # a TRL user's vLLM config: generated ahead on the server
        vllm_mode="server",
        vllm_server_port=port,
        weight_sync_transport="nccl" if mode == "vllm-nccl-standin" else "disk",
        weight_sync_dir=str(out_dir / "weight_sync"),
        lora_weight_sync="adapter" if mode == "vllm-lora-adapter" else "merged",
    )
    if mode == "vllm-nccl-standin":
        import trl.generation.vllm_client

        import trl_a3po.rollout.weight_transport as weight_transport

        trl.generation.vllm_client.VLLMClient = RecordingClient
        torch.cuda.current_device = lambda: 0  # what NCCLTransport asks for; no GPU here
        weight_transport.trainer_vllm_version = lambda: "0.31.0"  # the server's release, on the trainer side
        server["vllm_group_port"] = 51277
else:
    model = make_model(tokenizer)
if run_name.endswith("-iterable"):
    dataset = dataset.to_iterable_dataset(num_shards=2)  # as many shards as processes: Accelerate shards by them
args = A3POConfig(
    output_dir=str(out_dir / mode),
    per_device_train_batch_size=2,
    num_generations=4,
    max_completion_length=96 if agentic else 6,
    steps_per_generation=2,
    max_steps=8,
    logging_steps=1,
    report_to="none",
    use_cpu=not zero3,
    save_strategy="no",
    seed=0,
    bf16=False,
    learning_rate=1e-4 if agentic else 1e-2,
    async_generation=not mode.startswith("sync"),
    max_staleness=2,
    **server,
    inflight_weight_updates=inflight,
    continuous_generation="continuous" in mode,
    record_generation_batches=str(out_dir / "recording") if mode == "async-replay" else None,
    # DeepSpeed on CPU: `use_cpu` would bypass it; gloo instead of NCCL; fp32
    **({"ddp_backend": "gloo"} if zero3 else {}),
)
peft_config = None
if mode.startswith("vllm-lora"):  # the server receives the merged weights (W + scale * B @ A) or the adapter
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
trainer = A3POTrainer(
    model=model,
    reward_funcs=recorded_reward,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    peft_config=peft_config,
    tools=[add] if mode.endswith("-tools") else None,
    environment_factory={"-env": AddingEnvironment, "-reset": FailingReset}.get(mode[mode.rfind("-") :]),
    rollout_func=divides if mode.endswith("raise-rollout-func") else None,
)
versions = VersionRecorder(trainer)
trainer.add_callback(versions)
samples = record_trained_samples(trainer)
rank = trainer.accelerator.process_index
if "raise-" in mode:
    try:
        trainer.train()
    except (ZeroDivisionError, ResetFailed) as error:  # as a user catches their own error around train()
        caught = {"caught": type(error).__name__, "notes": getattr(error, "__notes__", [])}
        (out_dir / f"{run_name}-rank{rank}.json").write_text(json.dumps(caught))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
trainer.train()
if mode == "async-replay":  # the weights as training left them (the version check below loads older versions)
    trained = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
checked = 0
if mode != "vllm-nccl-standin":  # the stand-in pushes nothing: the server keeps its first weights
    checked = check_behaviour_logprobs_against_versions(
        trainer, versions, samples, atol=1e-3 if mode.startswith("vllm") else 1e-5
    )
replayed = {}
if mode == "async-replay":  # the recorded anchor replayed on the recording, from the same initial weights
    from trl_a3po.replay import ReplayTrainer, replay_config

    replay = ReplayTrainer(
        make_model(tokenizer),
        args=replay_config(str(out_dir / "recording"), "loglinear", str(out_dir / "replay")),
        train_dataset=dataset,
        processing_class=tokenizer,
        recording=str(out_dir / "recording"),
        anchor="loglinear",
    )
    replay.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (trainer, replay)]
    weights = [trained, dict(replay.accelerator.unwrap_model(replay.model).named_parameters())]
    replayed = {
        "losses": losses,
        "weight_differences": {
            name: (weights[0][name] - weights[1][name]).abs().max().item()
            for name in weights[0]
            if not torch.equal(weights[0][name], weights[1][name])
        },
        "batch_files": sorted(p.name for p in (out_dir / "recording" / "batches").iterdir()),
    }
# Under ZeRO-3 each process holds only its partition of every parameter (outside a gather).
params = list(trainer.model_wrapped.parameters()) if zero3 else []
held = sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor"))
partitioned_fraction = held / max(sum(p.ds_numel for p in params if hasattr(p, "ds_numel")), 1)
staleness = [h["a3po/staleness/max"] for h in trainer.state.log_history if "a3po/staleness/max" in h]
(out_dir / f"{run_name}-rank{rank}.json").write_text(
    json.dumps(
        {
            "prompts": seen,
            "staleness_max": staleness,
            "eta": args.max_staleness,
            "world": trainer.accelerator.num_processes,
            "checked": checked,
            "behaviour_versions": sorted({int(v) for s in samples for v in s["behavior_version"].unique()}),
            "mixed": sum(
                len(s["behavior_version"][row][model_tokens(s)[row]].unique()) > 1
                for s in samples
                for row in range(len(s["behavior_version"]))
            ),
            "client_calls": RecordingClient.calls,
            "partitioned_fraction": partitioned_fraction,
            "client_updates": RecordingClient.updates,
            "group_ports": RecordingClient.group_ports,
            "parameter_names": sorted(name for name, _ in trainer.model.named_parameters()),
            "replayed": replayed,
        }
    )
)
# A clean exit: every rank done, then the process group torn down (gloo's threads otherwise race interpreter
# shutdown, which was seen to abort one rank with "terminate called without an active exception").
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
# Everything this run reports is written; skip the interpreter's teardown, where gloo's C++ threads can still abort a
# rank ("terminate called without an active exception", seen in CI after a run that had finished and reported).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
