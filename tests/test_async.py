"""A3POTrainer with the asynchronous producer: order, staleness bound, LoRA snapshot, faults, resume."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import digit_reward, free_port, generate_two_versions_ahead, make_model, producer_threads
from transformers import TrainerCallback
from test_trainer import COMMON, logged

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout import GenerationQueue, InProcessBackend, ProducerError, build_whole_snapshot
from trl_a3po.rollout.vllm_server import VLLMServerUnreachable


class Recorder:
    """Reward function that records the prompts it scores (one call per generation batch, in training order)."""

    __name__ = "recorded_digit_reward"

    def __init__(self):
        self.prompts = []

    def __call__(self, prompts, completions, **kwargs):
        self.prompts.append(list(prompts))
        return digit_reward(completions)


def slow_generation(monkeypatch, seconds_per_token=0.02):
    """Slow the producer's generation down (it asks whether a newer version is due once per token), so that with
    in-flight weight updates versions are published in the middle of sequences."""
    newer_version_due = GenerationQueue._newer_version_due
    monkeypatch.setattr(GenerationQueue, "_newer_version_due",
                        lambda queue: time.sleep(seconds_per_token) or newer_version_due(queue))


NEWER_VERSION_DUE = GenerationQueue._newer_version_due  # as defined, before any test patches it


def wait_for_the_next_version(queue) -> bool:
    """`GenerationQueue._newer_version_due` for continuous generation with in-flight updates, where a race decides
    whether versions change mid-sequence: in-process, the first batches are merged into one `generate` and only the
    last is left to be caught (a slow machine's trainer once lost at 60 ms per token); on a vLLM server every batch
    streams at once, and a loaded machine's trainer published only after all had ended. Instead, a stream (thread
    `a3po-stream-<its first batch>`) that holds only batches the trainer does not need yet (every index above the newest
    published version: the trainer trains that version's batch and publishes the next one without them) waits, at each
    token, until a newer version is due; so every run has versions change mid-sequence, on any machine."""
    thread = threading.current_thread().name
    if thread.startswith("a3po-stream-"):
        first_batch = int(thread.removeprefix("a3po-stream-"))
        deadline = time.monotonic() + 120
        while first_batch > queue.published_version and not NEWER_VERSION_DUE(queue) and not queue._stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{thread}: no version after {queue.published_version} published in 120 s")
            time.sleep(0.01)
    return NEWER_VERSION_DUE(queue)


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


@pytest.mark.parametrize("steps_per_generation,max_staleness", [(1, None), (3, 1), (2, 3)])
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
    assert eta == (max_staleness or 2)
    staleness_max = logged(trainer, "a3po/staleness/max")
    assert len(staleness_max) == trainer.state.global_step and max(staleness_max) <= eta
    # histogram inputs: per step, the shares of samples at staleness 0..eta sum to 1 and match the mean
    fracs = [logged(trainer, f"a3po/staleness/frac_d{d}") for d in range(eta + 1)]
    for step, mean in enumerate(logged(trainer, "a3po/staleness/mean")):
        assert sum(f[step] for f in fracs) == pytest.approx(1.0)
        assert sum(d * f[step] for d, f in enumerate(fracs)) == pytest.approx(mean)
    # one queue entry per generation batch; never more generated batches waiting than the bound lets run ahead
    num_batches = len(runs["async"][0])
    for key in ("a3po/queue/trainer_wait_s", "a3po/queue/producer_idle_s", "a3po/gen/tokens_per_s",
                "a3po/gen/weight_sync_s"):
        assert len(logged(trainer, key)) == num_batches, key
    assert all(depth in range(eta + 1) for depth in logged(trainer, "a3po/queue/depth"))
    assert producer_threads() == []  # the producer is stopped when training ends


def test_async_max_staleness_2_uses_alpha_one_half(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    # 4 optimizer steps per generation batch, two batches ahead: batch k may be generated by version k - 2.
    import trl_a3po.trainer as trainer_module

    alphas_used = []
    real = trainer_module.approximate_prox_logp

    def recording(method, behav_logp, logp, staleness):
        prox = real(method, behav_logp, logp, staleness)
        stale = staleness == 2
        if stale.any():  # the loss's anchor at d = 2 is the midpoint of behaviour and current log-probs
            expected = 0.5 * behav_logp[stale] + 0.5 * logp.detach()[stale]
            assert torch.allclose(prox[stale], expected, atol=1e-6)
        alphas_used.extend(staleness.flatten().tolist())
        return prox

    monkeypatch.setattr(trainer_module, "approximate_prox_logp", recording)
    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=4, max_steps=24, max_staleness=2)
    trainer.train()
    staleness = logged(trainer, "a3po/staleness/max")
    assert len(staleness) == 24 and max(staleness) <= 2
    assert staleness[:4] == [0] * 4  # the first batch can only come from version 0
    assert staleness.count(2) >= 4, staleness  # the producer ran two batches ahead at least once
    # one version per training step: the staleness is constant over each group of 4 optimizer steps
    assert all(len(set(staleness[i:i + 4])) == 1 for i in range(0, 24, 4))
    for d, alpha in zip(logged(trainer, "a3po/staleness/mean"), logged(trainer, "a3po/alpha/mean")):
        assert alpha == {0: 1.0, 1: 1.0, 2: 0.5}[d]
    assert 2 in alphas_used


def test_a_default_async_run_engages_the_a3po_approximation(tmp_path, tokenizer, prompt_dataset):
    # A-3PO on by default: max_staleness resolves to 2, and steps trained at staleness 2 use alpha 1/2 (< 1).
    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=2, max_steps=12)
    assert trainer.args.max_staleness == 2
    trainer.train()
    pairs = list(zip(logged(trainer, "a3po/staleness/mean"), logged(trainer, "a3po/alpha/mean")))
    assert any(d == 2 for d, _ in pairs), pairs  # the producer ran two versions ahead
    for d, alpha in pairs:
        assert alpha == (0.5 if d == 2 else 1.0)


class VersionRecorder(TrainerCallback):
    """The weights of every policy version, taken independently of the queue: at the start of each training step
    (global_step a multiple of the optimizer steps per version), the live weights are that version."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.weights = {}

    def on_step_begin(self, args, state, control, **kwargs):
        per_version = args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        if state.global_step % per_version == 0:
            if self.trainer._dist.is_zero3:  # partitioned: gather the whole weights (a collective, every rank is here)
                with self.trainer._full_policy_tensors() as tensors:
                    weights = {name: tensor.detach().clone() for name, tensor in tensors}
            else:
                weights = {name: tensor.detach().clone() for name, tensor in self.trainer.model.state_dict().items()}
            self.weights[state.global_step // per_version] = weights


def record_trained_samples(trainer, keys=("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                          "sampling_per_token_logps", "behavior_version")):
    samples = []
    original = trainer._compute_loss

    def recording(model, inputs):
        samples.append({key: inputs[key].detach().clone() for key in keys if key in inputs})
        return original(model, inputs)

    trainer._compute_loss = recording
    return samples


def check_behaviour_logprobs_against_versions(trainer, versions, samples, atol, temperature=None):
    """For every trained sample: its behaviour log-probs equal those the weights of its recorded behaviour version
    give it (a forward of those weights after training, at `temperature`: default the learner's). Returns the number
    of samples checked."""
    replay = trainer.model  # TRL's patched forward; training is over, so it can carry each version's weights
    logps = trainer._get_per_token_logps_and_entropies
    # Partitioned parameters, or another temperature than the one TRL's patched forward bakes in: replay on a whole,
    # plain copy of the architecture instead.
    if trainer._dist.is_zero3 or temperature is not None:
        replay = build_whole_snapshot(trainer.accelerator.unwrap_model(trainer.model), torch.device("cpu"))
        temperature = temperature or trainer.temperature

        def logps(model, input_ids, attention_mask, logits_to_keep):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1 : -1]
            logp = torch.log_softmax(logits.float() / temperature, -1)
            return logp.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1), None, None
    replay.eval()
    checked = 0
    for inputs in samples:
        mask = inputs["completion_mask"].bool()
        token_versions = inputs["behavior_version"]
        assert token_versions.shape == mask.shape  # one version per completion token
        seen = torch.zeros_like(mask)
        for version in token_versions[mask].unique().tolist():
            tokens = (token_versions == version) & mask
            rows = tokens.any(-1)
            replay.load_state_dict(versions.weights[version])
            with torch.no_grad():
                logp, _, _ = logps(
                    replay,
                    torch.cat([inputs["prompt_ids"][rows], inputs["completion_ids"][rows]], 1),
                    torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], 1),
                    inputs["completion_ids"].size(1),
                )
            diff = (logp - inputs["sampling_per_token_logps"][rows]).abs()[tokens[rows]]
            assert diff.max().item() < atol, (version, diff.max().item())
            seen |= tokens
        assert torch.equal(seen, mask)  # every trained token was checked against its own version
        checked += mask.size(0)
    return checked


@pytest.mark.parametrize("async_generation", [True, False])
def test_every_sample_behaviour_logprobs_come_from_its_recorded_version(tmp_path, tokenizer, prompt_dataset,
                                                                        async_generation):
    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=2, max_steps=12, max_staleness=2,
                   learning_rate=1e-2, async_generation=async_generation)
    versions = VersionRecorder(trainer)
    trainer.add_callback(versions)
    samples = record_trained_samples(trainer)
    trainer.train()
    assert len(samples) == 12
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-5) == 12 * 4
    # the check has teeth: versions differ (the learning rate moves the weights), and async runs ahead
    first, last = versions.weights[0], versions.weights[max(versions.weights)]
    assert any(not torch.allclose(first[k], last[k]) for k in first)
    staleness = logged(trainer, "a3po/staleness/max")
    assert max(staleness) == (2 if async_generation else 0)


@pytest.mark.parametrize("continuous", [False, True])
def test_inflight_weight_updates_keep_every_token_on_its_recorded_version(tmp_path, tokenizer, prompt_dataset,
                                                                         monkeypatch, continuous):
    # In-flight updates on: generation slowed (20 ms a token) so that versions are published mid-sequence. Every
    # trained token's behaviour log-prob is what its own recorded version gives it, sequences do mix versions, the
    # bound holds per token, and the prompt order is the synchronous run's. Continuous: the batches waiting are
    # generated together in one `generate`, a stopped generation's tail with the next batch's rows.
    slow_generation(monkeypatch)
    rows_per_call = []
    generate_until = InProcessBackend.generate_until
    monkeypatch.setattr(InProcessBackend, "generate_until", lambda backend, prompt_ids, *args, **kwargs: (
        rows_per_call.append(len(prompt_ids)) or generate_until(backend, prompt_ids, *args, **kwargs)))
    runs = {}
    for mode in ("sync", "inflight"):
        reward = Recorder()
        trainer = make(tmp_path / mode, tokenizer, prompt_dataset, reward=reward, steps_per_generation=2, max_steps=12,
                       max_staleness=2, learning_rate=1e-2, max_completion_length=16,
                       async_generation=mode == "inflight", inflight_weight_updates=mode == "inflight",
                       continuous_generation=continuous and mode == "inflight")
        versions = VersionRecorder(trainer)
        trainer.add_callback(versions)
        samples = record_trained_samples(trainer)
        trainer.train()
        runs[mode] = reward.prompts
    assert runs["inflight"] == runs["sync"]
    # more rows in one call than a generation batch has = several batches generated together (continuous only)
    assert (max(rows_per_call) > trainer.args.generation_batch_size) == continuous, rows_per_call
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-5) == 12 * 4
    assert max(logged(trainer, "a3po/gen/mixed_version_frac")) > 0
    assert sum(len(set(s["behavior_version"][row][s["completion_mask"][row].bool()].tolist())) > 1
               for s in samples for row in range(4)) > 0
    assert max(logged(trainer, "a3po/staleness/max")) <= 2
    assert producer_threads() == []


def test_in_process_generate_until_gives_each_row_its_own_budget_and_the_behaviour_logprobs(tokenizer):
    # Rows of different lengths and histories in one call (continuous generation merges batches; in flight, rows
    # continue after different numbers of tokens): row r samples at most max_new_tokens - generated[r] tokens, and
    # each token's log-prob is what the model gives it after that row's own (left-padded) prefix.
    from transformers import GenerationConfig

    model = make_model(tokenizer).eval()
    config = GenerationConfig(do_sample=True, max_new_tokens=6, pad_token_id=0, eos_token_id=1, temperature=1.0,
                              top_k=0, top_p=1.0)
    backend = InProcessBackend(model, config, pad_token_id=0, eos_token_ids=[1])
    prompts, generated = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15]], [0, 2, 5, 3]
    asked = []
    torch.manual_seed(0)
    ids, logprobs, unfinished = backend.generate_until(prompts, threading.Event(), lambda: asked.append(1) or False,
                                                       generated)
    for row, (prompt, done) in enumerate(zip(prompts, generated)):
        budget = 6 - done
        ended = bool(ids[row]) and ids[row][-1] == 1
        assert len(ids[row]) == len(logprobs[row]) and (len(ids[row]) == budget or ended), (row, ids[row])
        assert not unfinished[row]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids[row]])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[row])[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(logprobs[row]), expected, atol=1e-5), row
    assert len(asked) == max(map(len, ids))  # asked after every token
    # stopped after the third token: rows with budget and no EOS yet come back unfinished, all cut there; the others
    # finished by then (budgets 6, 4, 1, 3)
    asked.clear()
    ids, _, unfinished = backend.generate_until(prompts, threading.Event(), lambda: asked.append(1) or len(asked) == 3,
                                                generated)
    stopped_at = 3
    assert unfinished[:2] == [ids[0][-1] != 1, ids[1][-1] != 1] and unfinished[2:] == [False, False]
    for row, budget in enumerate(6 - done for done in generated):
        if unfinished[row]:
            assert len(ids[row]) == stopped_at < budget and ids[row][-1] != 1
        else:
            assert len(ids[row]) <= stopped_at and (len(ids[row]) == budget or ids[row][-1] == 1)


def test_async_lora_snapshot_generates_with_the_merged_policy(tmp_path, tokenizer, prompt_dataset):
    from peft import LoraConfig

    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=2, max_steps=4,
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainer.train()
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert any(torch.count_nonzero(p) > 0 for p in lora_b)  # the adapter trained, so merging matters
    # A fresh snapshot refreshed from the trainer's merged tensors computes what the PEFT model computes.
    from transformers import AutoModelForCausalLM

    snapshot = AutoModelForCausalLM.from_config(trainer.model.get_base_model().config)
    backend = InProcessBackend(snapshot, trainer.generation_config, 0, [1])
    with trainer._full_policy_tensors() as tensors:
        backend.load(backend.stage(tensors))
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
    assert producer_threads() == []  # stopped, no thread left behind


def test_unreachable_vllm_server_fails_fast_naming_host_and_port(tmp_path, tokenizer, prompt_dataset):
    port = free_port()
    trainer = make(tmp_path, tokenizer, prompt_dataset, rollout_backend="vllm_server", vllm_server_port=port,
                   max_steps=1)
    start = time.perf_counter()
    with pytest.raises(VLLMServerUnreachable, match=f"127.0.0.1:{port}"):
        trainer.train()
    assert time.perf_counter() - start < 30


# a batch boundary, inside one; inside one with in-flight updates, with continuous generation
@pytest.mark.parametrize("steps_per_generation,shards", [(1, 1), (2, 1), (2, 3)])
def test_an_iterable_dataset_trains_asynchronously_in_the_synchronous_prompt_order(tmp_path, tokenizer, prompt_dataset,
                                                                                  steps_per_generation, shards):
    # A streamed dataset (TRL: buffered shuffle, repeats baked into the stream) has no sampler to replay: the producer
    # reads the stream ahead of the trainer, past the end of an epoch too (6 prompts, 1 or 2 per generation batch:
    # a reshuffled second epoch).
    runs = {}
    for mode in ("sync", "async"):
        reward = Recorder()
        trainer = make(tmp_path / mode, tokenizer, prompt_dataset.select(range(6)).to_iterable_dataset(shards),
                       reward=reward, steps_per_generation=steps_per_generation, max_steps=10,
                       async_generation=(mode == "async"))
        if mode == "async":
            generate_two_versions_ahead(trainer)
        trainer.train()
        runs[mode] = ([sorted(set(prompts)) for prompts in reward.prompts], trainer)
    prompts = runs["sync"][0]
    assert len(prompts) == 10 // steps_per_generation
    assert runs["async"][0] == prompts  # same prompts, same batches, same order
    epoch = 6 // steps_per_generation  # generation batches per epoch
    assert len(set(sum(prompts[:epoch], []))) == 6  # the first epoch: every prompt once
    assert prompts[epoch:] != prompts[: len(prompts) - epoch]  # the second epoch is reshuffled, and still followed
    # staleness 2 from the third generation batch on (a version = one generation batch's optimizer steps)
    assert logged(runs["async"][1], "a3po/staleness/max")[2 * steps_per_generation:] == [2] * (
        10 - 2 * steps_per_generation)
    assert producer_threads() == []


@pytest.mark.parametrize("resume_step,inflight,continuous,iterable", [
    (3, False, False, False), (2, False, False, False), (2, True, False, False), (2, False, True, False),
    (2, False, False, True)])
def test_resume_continues_the_order_without_skipping_or_repeating(tmp_path, tokenizer, prompt_dataset, resume_step,
                                                                 inflight, continuous, iterable):
    kwargs = dict(steps_per_generation=3, max_steps=9, save_strategy="steps", save_steps=resume_step,
                  inflight_weight_updates=inflight, continuous_generation=continuous)
    dataset = prompt_dataset.to_iterable_dataset() if iterable else prompt_dataset
    full = make(tmp_path / "full", tokenizer, dataset, **kwargs)
    full_batches = record_microbatches(full)
    full.train()
    assert len(full_batches) == 9

    resumed = make(tmp_path / "resumed", tokenizer, dataset, **kwargs)
    resumed_batches = record_microbatches(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{resume_step}"))
    # micro-batches after the checkpoint carry exactly the prompts the uninterrupted run trained there
    assert resumed_batches == full_batches[resume_step:]
    assert resumed.state.global_step == 9


def test_a_run_killed_mid_step_resumes_from_its_checkpoint_in_the_synchronous_order(tmp_path):
    # SIGKILL at the end of step 5 (the producer generating ahead), resume from checkpoint-4 in a new process with a
    # fresh producer: the resumed run trains exactly the micro-batches the uninterrupted run trained after step 4,
    # nothing twice (beyond the killed step, whose update died with the process) and nothing skipped.
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "scripts" / "killed_run.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(mode):
        result = subprocess.run([sys.executable, str(script), str(tmp_path), mode], env=env, capture_output=True,
                                text=True, timeout=300)
        return result.returncode, [json.loads(line) for line in (tmp_path / f"{mode}.jsonl").read_text().splitlines()]

    rc, full = run("full")
    assert rc == 0 and len(full) == 9
    rc, killed = run("killed")
    assert rc == -signal.SIGKILL and (tmp_path / "killed" / "checkpoint-4").exists()
    assert not (tmp_path / "killed" / "checkpoint-6").exists()
    rc, resumed = run("resumed")
    assert rc == 0
    assert killed == full[:5]  # up to the kill: the synchronous order
    assert resumed == full[4:]  # from the checkpoint on: the same micro-batches, in the same order


class _FailingOptimizerStep(TrainerCallback):
    """At optimizer step `at_step` + 1, once the producer is mid-generation (`generating` set; 10 s at most), the real
    `optimizer.step()` fails (a step pre-hook raises), or a SIGINT (Ctrl-C) lands inside it."""

    def __init__(self, how, at_step=1, generating=None):
        self.how, self.at_step, self.generating = how, at_step, generating

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        def hook(opt, *_):
            if state.global_step == self.at_step:
                if self.generating is not None:
                    self.generating.wait(10)
                if self.how == "raise":
                    raise RuntimeError("simulated out of memory in optimizer.step")
                os.kill(os.getpid(), signal.SIGINT)

        getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(hook)  # inside Accelerate's wrapper


@pytest.mark.parametrize("how", ["raise", "sigint"])
@pytest.mark.parametrize("inflight,continuous", [(False, False), (True, False), (False, True)])
def test_a_failure_during_training_ends_train_fast_with_no_thread_left(tmp_path, tokenizer, prompt_dataset,
                                                                       monkeypatch, request, how, inflight, continuous):
    if how == "sigint":
        # A process started in the background (`nohup ... &`) inherits SIGINT ignored, and Python then installs no
        # KeyboardInterrupt handler: install the one a Ctrl-C in a terminal meets.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    # From the second batch on, generation takes 0.5 s per token for 64 tokens (32 s): the producer is mid-generation
    # when the optimizer step fails, and only the stop signal can end it early.
    # (With in-flight updates, the generation is the backend's `generate_until`, and may switch versions meanwhile;
    # with continuous generation it is `generate_until` too, in a stream thread of the coordinator's.)
    mid_generation = threading.Event()
    method = "generate_until" if inflight or continuous else "generate"
    real = getattr(InProcessBackend, method)
    calls = {"n": 0}

    def slow(self, prompt_ids, stop, *args, **kwargs):
        calls["n"] += 1
        # continuous: batches 0-2 may be one generation or two, all started before version 1 (optimizer step 2);
        # the first generation after it (batch 3) crawls
        if (calls["n"] == 2) if not continuous else (trainer.state.global_step >= 2 and "crawl" not in calls):
            calls["crawl"] = True

            def crawl(module, args):
                mid_generation.set()
                time.sleep(0.5)

            self.snapshot.register_forward_pre_hook(crawl)
        return real(self, prompt_ids, stop, *args, **kwargs)

    monkeypatch.setattr(InProcessBackend, method, slow)
    trainer = make(tmp_path, tokenizer, prompt_dataset, steps_per_generation=2, max_steps=8,
                   max_completion_length=64, inflight_weight_updates=inflight, continuous_generation=continuous)
    # Continuous: batch 3, the first generated after version 1 is published (optimizer step 2), crawls: the failure
    # comes during optimizer step 4.
    at_step = 3 if continuous else 1
    trainer.add_callback(_FailingOptimizerStep(how, at_step, mid_generation))
    start = time.perf_counter()
    expected = RuntimeError if how == "raise" else KeyboardInterrupt
    with pytest.raises(expected) as info:
        trainer.train()
    elapsed = time.perf_counter() - start
    if how == "raise":
        assert "simulated out of memory" in str(info.value)  # the original error, not a wrapper
    assert mid_generation.is_set()
    assert elapsed < 15, elapsed
    assert trainer.state.global_step == at_step
    assert producer_threads() == []  # the producer and, continuous, every stream thread


@pytest.mark.parametrize("case", ["tools", "grpo_config", "dora", "ia3", "lora_bias", "images",
                                  "images_coupled"])
def test_unsupported_inputs_are_refused_before_any_model_work(tmp_path, tokenizer, prompt_dataset, monkeypatch, case):
    from peft import IA3Config, LoraConfig

    from trl import GRPOConfig, GRPOTrainer

    def trl_init(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    args = A3POConfig(output_dir=str(tmp_path), **COMMON)
    kwargs = dict(model="never-loaded", reward_funcs=digit_reward, args=args, train_dataset=prompt_dataset)
    if case == "tools":
        kwargs["tools"] = [len]
        error, pattern = ValueError, r"tools, environment_factory and rollout_func need async_generation=False"
    elif case == "dora":  # adapters the merged export cannot reproduce: the generator would run another policy
        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
        error, pattern = ValueError, r"cannot represent LoRA with use_dora=True .* or set async_generation=False"
    elif case == "ia3":
        kwargs["peft_config"] = IA3Config(target_modules=["q_proj"], feedforward_modules=[])
        error, pattern = ValueError, r"cannot represent a IA3Config adapter"
    elif case == "lora_bias":
        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True)
        error, pattern = ValueError, r"cannot represent LoRA with lora_bias=True"
    elif case == "images":  # the decoupled loss would drop pixel inputs from the loss and the proximal forward
        kwargs["train_dataset"] = prompt_dataset.add_column("image", [None] * len(prompt_dataset))
        error, pattern = ValueError, r"decoupled loss is text-only: the image inputs of this dataset \(its \['image'\]"
    elif case == "images_coupled":  # GRPOTrainer's own loss, but generated ahead from the text prompts alone
        kwargs["args"] = A3POConfig(output_dir=str(tmp_path), use_decoupled_loss=False, async_generation=True,
                                    max_staleness=0, **COMMON)
        kwargs["train_dataset"] = prompt_dataset.add_column("images", [None] * len(prompt_dataset))
        error, pattern = ValueError, r"generates from text prompts alone: this dataset's \['images'\] column"
    else:
        kwargs["args"] = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
        error, pattern = TypeError, r"A3POTrainer needs an A3POConfig as `args`, got GRPOConfig"
    with pytest.raises(error, match=pattern):
        A3POTrainer(**kwargs)
    if case in ("dora", "ia3", "lora_bias"):  # synchronous generation runs the live PEFT model: TRL's business
        kwargs["args"] = A3POConfig(output_dir=str(tmp_path), async_generation=False, **COMMON)
        with pytest.raises(AssertionError, match="GRPOTrainer.__init__ ran"):
            A3POTrainer(**kwargs)


def test_coupled_grpo_on_the_producer_at_max_staleness_0_is_synchronous(tmp_path, tokenizer, prompt_dataset):
    """The synchronous baseline with generation on the producer (the benchmark's sync on a vLLM server): every batch
    is generated by the version that trains it, so for every sample the generator's log-probs equal TRL's own "old"
    log-probs (its forward at the start of the training step), and the prompts follow the synchronous order."""
    runs = {}
    for mode, extra in (("queue", dict(async_generation=True, max_staleness=0)), ("sync", {})):
        reward = Recorder()
        trainer = make(tmp_path / mode, tokenizer, prompt_dataset, reward=reward, use_decoupled_loss=False,
                       steps_per_generation=2, max_steps=8, learning_rate=1e-2, **extra)
        seen = record_trained_samples(trainer, ("completion_mask", "old_per_token_logps", "sampling_per_token_logps"))
        trainer.train()
        runs[mode] = reward.prompts
        if mode == "queue":
            assert len(seen) == 8
            for inputs in seen:
                mask = inputs["completion_mask"].bool()
                diff = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).abs()[mask]
                assert diff.max().item() < 1e-5
            assert producer_threads() == []  # closed with train()
    assert runs["queue"] == runs["sync"]


@pytest.mark.parametrize("bad", [None, "", "   ", 7, [], [{"content": "no role"}]])
def test_a_row_without_a_usable_prompt_is_named_before_any_model_work(tmp_path, tokenizer, prompt_dataset, monkeypatch,
                                                                      bad):
    from datasets import Dataset

    from trl import GRPOTrainer

    def trl_init(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    prompts = list(prompt_dataset["prompt"])
    prompts[13] = bad
    # Arrow holds None and strings in one column; other mixed types need a plain map-style dataset
    dataset = Dataset.from_dict({"prompt": prompts}) if bad is None or isinstance(bad, str) else _ListDataset(prompts)
    args = A3POConfig(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(ValueError, match=r"train_dataset row 13: its 'prompt' is .*not usable as a prompt"):
        A3POTrainer(model="never-loaded", reward_funcs=digit_reward, args=args, train_dataset=dataset)


class _ListDataset(torch.utils.data.Dataset):
    """A map-style dataset of arbitrary Python prompts (Arrow would refuse a column of mixed types)."""

    column_names = ["prompt"]

    def __init__(self, prompts):
        self.prompts = prompts

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, key):
        return self.prompts if key == "prompt" else {"prompt": self.prompts[key]}


@pytest.mark.parametrize("rows", [0, 1])
def test_an_empty_or_too_small_dataset_is_refused_with_its_size(tmp_path, prompt_dataset, rows):
    # 4 samples per step x 2 steps per generation / 4 generations: 2 distinct prompts per generation batch
    args = A3POConfig(output_dir=str(tmp_path), **{**COMMON, "steps_per_generation": 2})
    with pytest.raises(ValueError, match=rf"train_dataset has {rows} rows, fewer than the 2 distinct prompts"):
        A3POTrainer(model="never-loaded", reward_funcs=digit_reward, args=args,
                    train_dataset=prompt_dataset.select(range(rows)))


def test_a_cooled_sampler_keeps_every_token_on_its_recorded_version(tmp_path, tokenizer, prompt_dataset):
    # sampling_temperature: each token's behaviour log-prob is its version's weights at the sampler's temperature
    trainer = make(tmp_path, tokenizer, prompt_dataset, max_steps=8, learning_rate=1e-2, temperature=1.0,
                   sampling_temperature=0.7)
    generate_two_versions_ahead(trainer)
    versions = VersionRecorder(trainer)
    trainer.add_callback(versions)
    samples = record_trained_samples(trainer)
    trainer.train()
    assert logged(trainer, "a3po/staleness/max") == [0, 1] + [2] * 6
    # the behaviour policy: the recorded version's weights at the sampler's temperature; the learner's is another one
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-5, temperature=0.7) == 8 * 4
    with pytest.raises(AssertionError):
        check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3, temperature=1.0)
