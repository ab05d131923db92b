"""Gathering sharded parameters for the generator, at unit level: FSDP2 over gloo in two CPU processes (Accelerate
runs FSDP only on accelerators, so A3POTrainer itself cannot be launched with FSDP here). ZeRO-3 runs for real, under
DeepSpeed on two CPU processes: tests/test_accelerate.py and tests/test_vllm_server.py."""

import contextlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testing_utils import COMMON, digit_reward, free_port, make_model, make_tokenizer

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout.policy_weights import _hf_named_tensors, policy_tensors


REPO = Path(__file__).resolve().parent.parent


def _fsdp2_gather(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        model = make_model(make_tokenizer())  # seeded: the same weights on both processes
        expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = {name: p.to_local().numel() for name, p in model.named_parameters() if isinstance(p, DTensor)}
        gathered = _hf_named_tensors(model, gather_dtensors=True)  # a collective: both processes call it
        report = {
            "sharded": len(local),
            "local_fraction": sum(local.values()) / sum(expected[n].numel() for n in local),
            "names_equal": sorted(gathered) == sorted(expected),
            "max_diff": max((gathered[n] - expected[n]).abs().max().item() for n in expected),
            "plain_tensors": all(not isinstance(t, DTensor) for t in gathered.values()),
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        # Both ranks done before either tears gloo down: a rank leaving while the other is still in a collective
        # aborted once at exit ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp2_greedy_eval(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from trl_a3po import GreedyEvalCallback, load_gsm8k
        from trl_a3po.evaluation import _render, generate_greedy_hf

        tokenizer = make_tokenizer()
        whole, model = make_model(tokenizer), make_model(tokenizer)  # seeded: equal weights
        dataset = load_gsm8k(os.path.join(REPO, "recipes", "data", "gsm8k"), "test", limit=4)
        expected = generate_greedy_hf(whole, tokenizer, _render(tokenizer, dataset["prompt"]), 6)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # What the recipe's callback does at an evaluation step, with FSDP2's sharded model as the trainer's
        callback = GreedyEvalCallback(dataset, tokenizer, every_steps=1, batch_size=2, max_new_tokens=6)
        callback.trainer = SimpleNamespace(
            _dist=SimpleNamespace(is_zero3=False, is_fsdp=True),
            accelerator=SimpleNamespace(is_main_process=rank == 0, wait_for_everyone=dist.barrier),
        )
        callback._model_for_generation = lambda sharded: contextlib.nullcontext(model)
        accuracy = callback._evaluate()
        texts = generate_greedy_hf(model, tokenizer, _render(tokenizer, dataset["prompt"]), 6, synced_gpus=True)
        with open(os.path.join(out_dir, f"eval{rank}.json"), "w") as f:
            json.dump({"accuracy": accuracy, "texts_equal": texts == expected}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_greedy_evaluation_runs_on_fsdp2_shards_in_every_process(tmp_path):
    # Evaluating on the main process alone hung under sharding: its forwards gather shards, a collective the other
    # processes never joined. Every process now generates, in step; a hang fails the test by its timeout.
    port = free_port()
    context = mp.spawn(_fsdp2_greedy_eval, args=(2, port, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the greedy evaluation hung under FSDP2")
    reports = [json.loads((tmp_path / f"eval{rank}.json").read_text()) for rank in range(2)]
    assert reports[0]["accuracy"] == 0.0 and reports[1]["accuracy"] is None  # the main process reports it
    assert reports[0]["texts_equal"] and reports[1]["texts_equal"]  # sharded greedy text == the whole model's


def test_fsdp2_shards_are_gathered_into_the_full_weights(tmp_path):
    port = free_port()
    mp.spawn(_fsdp2_gather, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["sharded"] > 0 and report["local_fraction"] == pytest.approx(0.5, abs=0.05)
        assert report["names_equal"] and report["plain_tensors"]
        assert report["max_diff"] == 0.0  # every process holds the whole, exact weights


def test_peft_on_sharded_parameters_is_refused_before_the_model_is_loaded(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    from peft import LoraConfig
    from trl import GRPOTrainer

    def trl_init(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ ran: the refusal came after model work")

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    args = A3POConfig(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(
        ValueError,
        match=r"async_generation=True with a PEFT adapter on sharded parameters .* set "
        r"async_generation=False",
    ):
        A3POTrainer(
            model=make_model(tokenizer),
            reward_funcs=digit_reward,
            args=args,
            train_dataset=prompt_dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )
    # synchronous generation with sharding and PEFT is TRL's business: not refused here
    sync = A3POConfig(output_dir=str(tmp_path), async_generation=False, **COMMON)
    with pytest.raises(AssertionError, match="GRPOTrainer.__init__ ran"):
        A3POTrainer(
            model=make_model(tokenizer),
            reward_funcs=digit_reward,
            args=sync,
            train_dataset=prompt_dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )


def test_zero3_weights_are_gathered_one_parameter_at_a_time_and_every_gather_runs(tokenizer):
    # What `policy_tensors` does under ZeRO-3, with a gather that records how many parameters are whole at once
    # (DeepSpeed's is a collective: every process must run every gather, in the same order).
    model = make_model(tokenizer)  # tied: lm_head.weight is the embedding
    whole_now, gathered = set(), []

    @contextlib.contextmanager
    def gather(parameters):
        assert len(parameters) == 1 and not whole_now, "more than one parameter whole at once"
        whole_now.add(id(parameters[0]))
        gathered.append(id(parameters[0]))
        yield
        whole_now.clear()

    dist = SimpleNamespace(is_zero3=True, gather_params=gather)
    expected = model.state_dict()
    with policy_tensors(model, dist) as named_tensors:
        got = {name: tensor.clone() for name, tensor in named_tensors}
    assert list(got) == list(expected)  # every entry, the tied lm_head included, in the state dict's order
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert len(gathered) == len(dict(model.named_parameters(remove_duplicate=False)))  # the tied one twice
    # A consumer that stops early (a failed staging copy) still runs every gather: the other processes are in them.
    gathered.clear()
    with pytest.raises(RuntimeError, match="staging failed"):
        with policy_tensors(model, dist) as named_tensors:
            next(named_tensors)
            raise RuntimeError("staging failed")
    assert len(gathered) == len(dict(model.named_parameters(remove_duplicate=False)))
    assert not whole_now
