"""A3POTrainer with the asynchronous producer: order, staleness bound, LoRA snapshot, faults, resume."""

import socket
import time

import pytest
import torch
from conftest import digit_reward, make_model
from test_trainer import COMMON, logged

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout import InProcessBackend, ProducerError
from trl_a3po.rollout.vllm_server import VLLMServerUnreachable


class Recorder:
    """Reward function that records the prompts it scores (one call per generation batch, in training order)."""

    __name__ = "recorded_digit_reward"

    def __init__(self):
        self.prompts = []

    def __call__(self, prompts, completions, **kwargs):
        self.prompts.append(list(prompts))
        return digit_reward(completions)


def make(tmp_path, tokenizer, dataset, reward=digit_reward, peft_config=None, **kwargs):
    args = A3POConfig(output_dir=str(tmp_path), **{**COMMON, **kwargs})
    return A3POTrainer(model=make_model(tokenizer), reward_funcs=reward, args=args, train_dataset=dataset,
                       processing_class=tokenizer, peft_config=peft_config)


def record_microbatches(trainer):
    """Record the prompt ids of every micro-batch the loss sees."""
    seen = []
    original = trainer._compute_loss

    def recording(model, inputs):
        rows = zip(inputs["prompt_ids"].tolist(), inputs["prompt_mask"].tolist())
        seen.append(sorted(tuple(i for i, m in zip(ids, mask) if m) for ids, mask in rows))
        return original(model, inputs)

    trainer._compute_loss = recording
    return seen


@pytest.mark.parametrize("steps_per_generation,max_staleness", [(1, None), (3, None), (2, 4)])
def test_async_trains_the_synchronous_prompt_order_within_the_bound(tmp_path, tokenizer, prompt_dataset,
                                                                    steps_per_generation, max_staleness):
    runs = {}
    for mode in ("sync", "async"):
        reward = Recorder()
        trainer = make(tmp_path / mode, tokenizer, prompt_dataset, reward=reward,
                       steps_per_generation=steps_per_generation, max_steps=9 if steps_per_generation == 3 else 8,
                       async_generation=(mode == "async"), max_staleness=max_staleness)
        trainer.train()
        runs[mode] = (reward.prompts, trainer)
    assert runs["async"][0] == runs["sync"][0]  # same prompts, same batches, same order: nothing dropped or repeated
    trainer = runs["async"][1]
    eta = trainer.args.max_staleness
    staleness_max = logged(trainer, "a3po/staleness/max")
    assert staleness_max and max(staleness_max) <= eta
    # histogram inputs: per step, the shares of samples at staleness 0..eta sum to 1 and match the mean
    fracs = [logged(trainer, f"a3po/staleness/frac_d{d}") for d in range(eta + 1)]
    for step, mean in enumerate(logged(trainer, "a3po/staleness/mean")):
        assert sum(f[step] for f in fracs) == pytest.approx(1.0)
        assert sum(d * f[step] for d, f in enumerate(fracs)) == pytest.approx(mean)
    assert len(logged(trainer, "a3po/queue/trainer_wait_s")) == len(runs["async"][0])
    for key in ("a3po/queue/producer_bound_wait_s", "a3po/queue/depth", "a3po/gen/tokens_per_s",
                "a3po/gen/weight_sync_s"):
        assert logged(trainer, key), key
    assert trainer._queue is None  # the producer is stopped when training ends


def test_async_lora_snapshot_generates_with_the_merged_policy(tmp_path, tokenizer, prompt_dataset):
    from peft import LoraConfig

    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=2, max_steps=4,
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainer.train()
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert any(torch.count_nonzero(p) > 0 for p in lora_b)  # the adapter trained, so merging matters
    # A fresh snapshot refreshed from the trainer's merged tensors computes what the PEFT model computes.
    from trl_a3po.rollout import PolicyWeights
    from transformers import AutoModelForCausalLM

    snapshot = AutoModelForCausalLM.from_config(trainer.model.get_base_model().config)
    backend = InProcessBackend(snapshot, PolicyWeights(trainer._policy_tensors), trainer.generation_config, 0, [1])
    backend.refresh()
    ids = torch.randint(5, 200, (2, 7))
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        got = snapshot(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)


def test_producer_exception_surfaces_in_the_trainer_within_a_step(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    calls = {"n": 0}
    real = InProcessBackend.generate

    def flaky(self, prompt_ids, min_version):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated generator crash")
        return real(self, prompt_ids, min_version)

    monkeypatch.setattr(InProcessBackend, "generate", flaky)
    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=2, max_steps=8)
    with pytest.raises(ProducerError, match="simulated generator crash") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, RuntimeError)
    # the crashed batch is the second one, generated during the first (steps 0-1): it surfaces by step 2
    assert trainer.state.global_step <= 2
    assert trainer._queue is None  # stopped, no thread left behind


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_vllm_server_fails_fast_naming_host_and_port(tmp_path, tokenizer, prompt_dataset):
    port = free_port()
    trainer = make(tmp_path, tokenizer, prompt_dataset, rollout_backend="vllm_server", vllm_server_port=port,
                   max_steps=1)
    start = time.perf_counter()
    with pytest.raises(VLLMServerUnreachable, match=f"127.0.0.1:{port}"):
        trainer.train()
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("resume_step", [3, 2])  # a generation batch boundary, and inside a batch
def test_resume_continues_the_order_without_skipping_or_repeating(tmp_path, tokenizer, prompt_dataset, resume_step):
    kwargs = dict(steps_per_generation=3, max_steps=9, save_strategy="steps", save_steps=resume_step)
    full = make(tmp_path / "full", tokenizer, prompt_dataset, **kwargs)
    full_batches = record_microbatches(full)
    full.train()
    assert len(full_batches) == 9

    resumed = make(tmp_path / "resumed", tokenizer, prompt_dataset, **kwargs)
    resumed_batches = record_microbatches(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{resume_step}"))
    # micro-batches after the checkpoint carry exactly the prompts the uninterrupted run trained there
    assert resumed_batches == full_batches[resume_step:]
    assert resumed.state.global_step == 9
