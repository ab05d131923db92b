"""Tools and environments generated ahead (A3POConfig's defaults: asynchronous): TRL's tool loop played by the
producer, tool calls off the main thread and concurrent, versions per token across turns."""

import asyncio
import os
import signal
import threading
import time

import pytest
from datasets import Dataset
from testing_utils import (
    COMMON,
    OBSERVATION,
    AddingEnvironment,
    DoublingEnvironment,
    check_behaviour_logprobs_against_versions,
    free_port,
    launch,
    logged,
    make_trainer,
    need_vllm_python,
    producer_threads,
    record_versions_and_samples,
    tool_model_saved,
    tool_question,
)
from transformers import TrainerCallback

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout.episodes import EpisodeRunner

from local_vllm import local_vllm_server


def agentic_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and t.name.startswith(("a3po-producer", "a3po-stream", "a3po-episode", "a3po-tool"))
    ]


class ToolCalls:
    """A test tool's record: the thread of every call (one entry per execution)."""

    def __init__(self):
        self.threads = []
        self._lock = threading.Lock()

    def record(self):
        with self._lock:
            self.threads.append(threading.current_thread().name)


def add_tool(on_call):
    """TRL's tool `add` (the tool model's), calling `on_call()` (the test's probe: record, raise, wait) first."""

    def add(a: int = 0, b: int = 0) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        on_call()
        return a + b

    return add


def sync_add(calls: ToolCalls):
    return add_tool(calls.record)


def async_add(calls: ToolCalls):
    async def add(a: int = 0, b: int = 0) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        calls.record()
        await asyncio.sleep(0)
        return a + b

    return add


def reward_prompts(recorded: list):
    """A reward with spread (the completion's message count and length), recording the prompts in the order scored."""

    def reward(prompts, completions, **kwargs):
        recorded.append([p[-1]["content"] for p in prompts])
        return [len(c) + len(c[-1].get("content") or "") / 100 for c in completions]

    return reward


AGENTIC = dict(max_completion_length=128, learning_rate=1e-4, max_steps=8, temperature=1.0)  # over COMMON


def config(tmp_path, **overrides):
    return A3POConfig(**{**COMMON, **AGENTIC, "output_dir": str(tmp_path), **overrides})


def tool_dataset(n=16, **columns):
    return Dataset.from_dict({"prompt": [tool_question(i) for i in range(n)], **columns})


def tool_trainer(tmp_path, model, tokenizer, tool, **config_kwargs) -> A3POTrainer:
    """`make_trainer` with this file's config: episodes that call `tool` on the addition prompts (no reward that
    matters)."""
    return make_trainer(
        tmp_path,
        tokenizer,
        tool_dataset(),
        model=model,
        reward=reward_prompts([]),
        tools=[tool],
        **{**AGENTIC, **config_kwargs},
    )


def newer_version_between_turns(trainer, monkeypatch):
    """Each episode's continuation (every turn after a batch's first) waits until the trainer has published a newer
    version than the generator holds, unless the generator already holds the batch's own version (the trainer
    then waits for this very batch: no newer version can come). Batches are played in order from 0, and version v + 1
    is published once batch v is trained, which never waits on a later batch: no deadlock. So episodes generated
    ahead span versions on any machine."""
    real_run = EpisodeRunner.run
    played = {"batches": 0}

    def run(self, rows, generate_turn):
        index, first = played["batches"], [True]
        played["batches"] += 1
        queue = trainer._rollout.queue

        def turn(prompt_ids):
            if not first[0]:
                wake = threading.Event()
                while (
                    queue._held_version < index
                    and queue.published_version <= queue._held_version
                    and not queue._stop.is_set()
                ):
                    wake.wait(0.005)  # a version the trainer publishes, read again
            first[0] = False
            return generate_turn(prompt_ids)

        return real_run(self, rows, turn)

    monkeypatch.setattr(EpisodeRunner, "run", run)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_tools_are_played_ahead_with_a_version_per_token(tmp_path, tool_tokenizer, tool_model, monkeypatch, kind):
    calls = ToolCalls()
    tool = (sync_add if kind == "sync" else async_add)(calls)
    trainer = tool_trainer(tmp_path, tool_model, tool_tokenizer, tool)
    assert trainer.args.async_generation  # A3POConfig's default
    versions, samples = record_versions_and_samples(trainer)
    newer_version_between_turns(trainer, monkeypatch)
    trainer.train()
    assert trainer.state.global_step == 8
    # Every parsed call was executed exactly once (TRL counts calls and failures; a failed call, e.g. wrong arguments,
    # never reaches the tool's body), and never on the main thread.
    per_step = trainer.args.generation_batch_size
    made = round(sum(f * per_step for f in logged(trainer, "tools/call_frequency")))
    failed = round(
        sum(
            f * c * per_step
            for f, c in zip(logged(trainer, "tools/failure_frequency"), logged(trainer, "tools/call_frequency"))
        )
    )
    assert made > 8, "the model should call its tool in most episodes"
    assert len(calls.threads) == made - failed
    assert "MainThread" not in calls.threads
    if kind == "sync":
        assert all(name == "a3po-tool-add" for name in calls.threads)
    # Per token: the behaviour log-prob is its recorded version's, in its context (prompt, turns, tool results).
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-5) == 32
    spanning = 0
    for inputs in samples:
        model_tokens = inputs["completion_mask"].bool() & inputs["tool_mask"].bool()
        for row, versions_row in zip(model_tokens, inputs["behavior_version"]):
            spanning += len(set(versions_row[row].tolist())) > 1
    assert spanning > 0, "no episode switched versions between turns"
    assert max(logged(trainer, "a3po/staleness/max")) <= trainer.args.max_staleness
    assert agentic_threads() == []


def test_tools_keep_the_synchronous_prompt_order(tmp_path, tool_tokenizer, tool_model_weights):
    from testing_utils import make_tool_model

    prompts = {}
    for mode in ("sync", "async"):
        model = make_tool_model(tool_tokenizer, steps=0)
        model.load_state_dict(tool_model_weights)
        prompts[mode] = []
        trainer = A3POTrainer(
            model,
            reward_prompts(prompts[mode]),
            args=config(tmp_path / mode, async_generation=mode == "async"),
            train_dataset=tool_dataset(),
            processing_class=tool_tokenizer,
            tools=[sync_add(ToolCalls())],
        )
        trainer.train()
    assert len(prompts["async"]) == 8 and prompts["async"] == prompts["sync"]


def test_failed_tool_calls_are_counted_and_never_hang_the_producer(tmp_path, tool_tokenizer, tool_model):
    """Every third call raises, every third hangs past `tool_timeout_s`; the model's own malformed calls fail too.
    Each is a failed call as TRL counts it (the model sees the error), and training goes on."""
    calls, release = ToolCalls(), threading.Event()

    def misbehave():
        calls.record()
        n = len(calls.threads)
        if n % 3 == 1:
            raise ValueError("the calculator is broken")
        if n % 3 == 2:
            release.wait(2)  # hangs past the timeout (then ends: a daemon thread nobody waits for)

    trainer = tool_trainer(tmp_path, tool_model, tool_tokenizer, add_tool(misbehave), tool_timeout_s=0.3)
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        release.set()
    assert trainer.state.global_step == 8
    per_step = trainer.args.generation_batch_size
    frequency, failure = logged(trainer, "tools/call_frequency"), logged(trainer, "tools/failure_frequency")
    made = round(sum(f * per_step for f in frequency))
    failed = round(sum(f * c * per_step for f, c in zip(failure, frequency)))
    executed = len(calls.threads)
    raised, hung = (executed + 2) // 3, (executed + 1) // 3
    assert executed >= 3 and failed >= raised + hung  # plus the malformed ones, which never reach the tool
    assert failed - raised - hung == made - executed  # exactly the calls that never ran
    assert time.perf_counter() - start < 120


@pytest.mark.parametrize("factories", ["one", "dict"])
def test_environments_are_played_ahead_and_score_their_own_episodes(tmp_path, tool_tokenizer, tool_model, factories):
    AddingEnvironment.resets.clear()
    if factories == "one":
        environment_factory, dataset = AddingEnvironment, tool_dataset()
    else:
        environment_factory = {"counter": AddingEnvironment, "doubler": DoublingEnvironment}
        dataset = tool_dataset(environment=["counter", "doubler"] * 8)
    scored = []

    def seen(prompts, completions, environments, **kwargs):  # a reward that reads the played environments
        # (read now: once scored, an instance goes back to the producer, which resets it for a later episode)
        names = kwargs.get("environment", [None] * len(prompts))
        scored.append(
            [(p, c, e.added, type(e), name) for p, c, e, name in zip(prompts, completions, environments, names)]
        )
        return [0.0] * len(prompts)

    trainer = A3POTrainer(
        tool_model,
        seen,
        args=config(tmp_path),
        train_dataset=dataset,
        processing_class=tool_tokenizer,
        environment_factory=environment_factory,
    )
    trainer.train()
    assert trainer.state.global_step == 8
    # reset once per episode trained, by the producer's episode threads (TRL's preamble got stand-ins)
    assert sum(AddingEnvironment.resets.values()) == 8 * trainer.args.generation_batch_size
    assert all(name.startswith("a3po-episode") for name in AddingEnvironment.resets)
    # The prompt trained is the one played (the reset observation appended), and the rewards read each episode's
    # own instance: its reward is the number of its tool results.
    assert len(scored) == 8
    assert sum(added for batch in scored for _, _, added, _, _ in batch) > 8  # tools were called
    kinds = {None: AddingEnvironment, "counter": AddingEnvironment, "doubler": DoublingEnvironment}
    for batch in scored:
        for prompt, completion, added, kind, name in batch:
            assert prompt[-1]["content"].endswith(OBSERVATION)
            assert added == sum(m["role"] == "tool" and not m["content"].startswith("{'error'") for m in completion)
            assert kind is kinds[name]
    assert len(logged(trainer, "rewards/AddingEnvironment/mean")) == 8  # the environment-owned reward, logged by TRL
    assert agentic_threads() == []


def test_tool_calls_of_different_episodes_run_at_the_same_time(tmp_path, tool_tokenizer, tool_model):
    """A tool that waits (2 s at most) until another call is inside it too: with tool calls run one after another, as
    TRL's loop runs them, no call would ever see another."""
    inside, met, changed = [0], [], threading.Condition()

    def meet():
        with changed:
            inside[0] += 1
            changed.notify_all()
            if changed.wait_for(lambda: inside[0] >= 2, timeout=2):
                met.append(threading.current_thread().name)
            inside[0] -= 1

    trainer = tool_trainer(tmp_path, tool_model, tool_tokenizer, add_tool(meet), max_steps=4)
    trainer.train()
    assert len(met) >= 2  # calls that found another call inside the tool at the same time


class _FailWhileAToolRuns(TrainerCallback):
    """At the second optimizer step, once a tool call is running, the optimizer step raises or a SIGINT lands."""

    def __init__(self, how, tool_running):
        self.how, self.tool_running, self.failed_at = how, tool_running, None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        def hook(opt, *_):
            if state.global_step == 1:
                assert self.tool_running.wait(30)
                self.failed_at = time.perf_counter()
                if self.how == "raise":
                    raise RuntimeError("simulated out of memory in optimizer.step")
                os.kill(os.getpid(), signal.SIGINT)

        getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(hook)


@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_a_failure_while_a_tool_runs_ends_train_fast_with_no_thread_left(
    tmp_path, tool_tokenizer, tool_model, request, how
):
    if how == "sigint":
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    running, calls = threading.Event(), ToolCalls()

    def slow_from_the_third_call():  # a slow API
        calls.record()
        if len(calls.threads) > 2:
            running.set()
            threading.Event().wait(3)

    trainer = tool_trainer(tmp_path, tool_model, tool_tokenizer, add_tool(slow_from_the_third_call), max_steps=16)
    failing = _FailWhileAToolRuns(how, running)
    trainer.add_callback(failing)
    with pytest.raises(RuntimeError if how == "raise" else KeyboardInterrupt):
        trainer.train()
    assert time.perf_counter() - failing.failed_at < 15
    assert producer_threads() == [] and agentic_threads() == []


# ---------------------------------------------------------------- on the CPU vLLM server


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tool_tokenizer, tool_model_weights):
    """A real `vllm serve` (CPU build) of the tool model, in dev mode, with processed log-probs."""
    python = need_vllm_python()
    root = tmp_path_factory.mktemp("tool-server")
    model_dir = tool_model_saved(root / "model", tool_tokenizer, tool_model_weights)
    port = free_port()
    with local_vllm_server(
        python, str(model_dir), port, str(root), max_model_len=1024, timeout_s=300, env={"HF_HUB_OFFLINE": "1"}
    ):
        yield {"port": port, "model_dir": model_dir}


def server_config(tmp_path, server, **overrides):
    return config(
        tmp_path,
        rollout_backend="vllm_server",
        vllm_server_port=server["port"],
        weight_sync_transport="disk",
        **overrides,
    )


@pytest.mark.parametrize("kind", ["tools", "environment"])
def test_episodes_on_the_vllm_server_carry_a_version_per_token(
    tmp_path, tool_server, tool_tokenizer, monkeypatch, kind
):
    from transformers import AutoModelForCausalLM

    calls = ToolCalls()
    trainer = A3POTrainer(
        AutoModelForCausalLM.from_pretrained(tool_server["model_dir"]),
        reward_prompts([]),
        args=server_config(tmp_path, tool_server),
        train_dataset=tool_dataset(),
        processing_class=tool_tokenizer,
        tools=[sync_add(calls)] if kind == "tools" else None,
        environment_factory=AddingEnvironment if kind == "environment" else None,
    )
    versions, samples = record_versions_and_samples(trainer)
    newer_version_between_turns(trainer, monkeypatch)
    trainer.train()
    assert trainer.state.global_step == 8
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-3) == 32
    spanning = sum(
        len(set(versions_row[row].tolist())) > 1
        for inputs in samples
        for row, versions_row in zip(
            inputs["completion_mask"].bool() & inputs["tool_mask"].bool(), inputs["behavior_version"]
        )
    )
    assert spanning > 0, "no episode switched versions between turns"
    assert max(logged(trainer, "a3po/staleness/max")) <= trainer.args.max_staleness
    if kind == "tools":
        assert calls.threads and "MainThread" not in calls.threads
    assert sum(logged(trainer, "tools/call_frequency")) > 1
    assert agentic_threads() == []


@pytest.fixture(scope="module")
def synchronous_tool_shards(tmp_path_factory, tool_server):
    """What each of two processes trains synchronously with tools (TRL's own loop, in-process generation)."""
    return launch(tmp_path_factory.mktemp("sync-tools"), "sync-tools", 0, tool_server["model_dir"])


@pytest.mark.parametrize("mode", ["vllm-tools", "vllm-env"])
def test_two_processes_share_the_servers_episodes(tmp_path, tool_server, synchronous_tool_shards, mode):
    """The server shape: the main process plays every episode (tools, environments), hands each process its share
    (environments pickled), and each trains the prompts the synchronous run gives it, every token checked against its
    recorded version."""
    ranks = launch(tmp_path, mode, tool_server["port"], tool_server["model_dir"])
    for rank, result in enumerate(ranks):
        assert result["world"] == 2
        assert result["checked"] == 16  # 8 optimizer steps x 2 samples per process, each token checked
        assert max(result["staleness_max"]) <= result["eta"] == 2
        prompts = [sorted(p.removesuffix(OBSERVATION) for p in batch) for batch in result["prompts"]]
        assert prompts == [sorted(batch) for batch in synchronous_tool_shards[rank]["prompts"]], rank


# ---------------------------------------------------------------- rollout_func


def two_turn_rollout(calls: list):
    """A rollout_func as TRL defines it, generating through `trainer.a3po_generate`: a first turn, a fixed "feedback"
    the environment adds (env_mask 0), a second turn; and a per-row field for the reward."""

    def rollout(prompts, trainer):
        calls.append(threading.current_thread().name)
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        first, first_logprobs = trainer.a3po_generate(prompt_ids)
        feedback = tokenizer(" = ?")["input_ids"]
        second, second_logprobs = trainer.a3po_generate([p + f + feedback for p, f in zip(prompt_ids, first)])
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [f + feedback + s for f, s in zip(first, second)],
            "logprobs": [fl + [0.0] * len(feedback) + sl for fl, sl in zip(first_logprobs, second_logprobs)],
            "env_mask": [[1] * len(f) + [0] * len(feedback) + [1] * len(s) for f, s in zip(first, second)],
            "turns": [2] * len(prompts),
        }

    return rollout


def test_a_rollout_func_runs_in_the_producer_with_its_version(tmp_path, tokenizer, model, prompt_dataset):
    calls, turns = [], []

    def reward(completions, turns_field=None, **kwargs):
        turns.extend(kwargs["turns"])
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    trainer = A3POTrainer(
        model,
        reward,
        args=config(tmp_path, max_completion_length=8, learning_rate=1e-3),
        train_dataset=prompt_dataset,
        processing_class=tokenizer,
        rollout_func=two_turn_rollout(calls),
    )
    versions, samples = record_versions_and_samples(trainer)
    trainer.train()
    assert trainer.state.global_step == 8
    assert calls and all(name == "a3po-producer" for name in calls)  # called ahead, never on the main thread
    assert turns == [2] * 32  # its per-row field reached the reward, row by row
    # each model token's behaviour log-prob is its recorded version's; the feedback tokens are masked (env_mask)
    assert check_behaviour_logprobs_against_versions(trainer, versions, samples, atol=1e-5) == 32
    assert all((s["tool_mask"] == 0).any() for s in samples)
    assert max(logged(trainer, "a3po/staleness/max")) > 0  # generated ahead


def rollout_func_trainer(tmp_path, model, tokenizer, dataset, rollout_func):
    """An A3POTrainer with a rollout_func and a zero reward (the rollout_func tests that expect `train()` to fail)."""
    return A3POTrainer(
        model,
        lambda completions, **kw: [0.0] * len(completions),
        args=config(tmp_path, max_completion_length=8),
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )


def test_a_rollout_func_that_generates_elsewhere_is_refused(tmp_path, tokenizer, model, prompt_dataset):
    def own_server(prompts, trainer):  # stands for a rollout_func that calls a server of its own
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [[5, 6]] * len(prompts), "logprobs": [[-1.0, -1.0]] * 4}

    trainer = rollout_func_trainer(tmp_path, model, tokenizer, prompt_dataset, own_server)
    with pytest.raises(ValueError, match=r"must generate through `trainer.a3po_generate\(prompt_ids\)`") as info:
        trainer.train()
    assert "in A-3PO's generation producer while playing the episodes of batch 0" in info.value.__notes__[-1]
    assert agentic_threads() == []


class ResetFailed(Exception):
    """A user's own exception type, raised by an environment."""


class FailingReset(AddingEnvironment):
    def reset(self, **row):
        raise ResetFailed(f"no such task: {row['prompt'][-1]['content'][:20]}")


def test_the_users_exceptions_in_the_producer_reach_train_as_themselves(
    tmp_path, tool_tokenizer, tool_model, tokenizer, model, prompt_dataset
):
    """An environment's reset, a rollout_func, a dataset row naming an unknown environment: `train()` raises the
    user's own exception type, as GRPOTrainer does, with a note naming where the producer was."""
    from trl import GRPOConfig, GRPOTrainer

    unknown = tool_dataset(environment=["nowhere"] * 16)
    factories = {"counter": AddingEnvironment}
    raised = {}
    for trainer_class, config_class in ((GRPOTrainer, GRPOConfig), (A3POTrainer, A3POConfig)):
        args = config_class(**{**COMMON, "max_completion_length": 128, "max_steps": 2, "output_dir": str(tmp_path)})
        trainer = trainer_class(
            tool_model,
            lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=unknown,
            processing_class=tool_tokenizer,
            environment_factory=factories,
        )
        with pytest.raises(ValueError, match=r"Example has `environment='nowhere'`, which is not among") as info:
            trainer.train()
        raised[trainer_class] = info.value
    assert str(raised[A3POTrainer]) == str(raised[GRPOTrainer])
    assert raised[A3POTrainer].__notes__ == [
        "(raised by a dataset row's environment ('nowhere'), in A-3PO's generation producer while playing the "
        "episodes of batch 0)"
    ]

    trainer = A3POTrainer(
        tool_model,
        lambda completions, **kw: [0.0] * len(completions),
        args=config(tmp_path),
        train_dataset=tool_dataset(),
        processing_class=tool_tokenizer,
        environment_factory=FailingReset,
    )
    with pytest.raises(ResetFailed, match="no such task") as info:
        trainer.train()
    assert "FailingReset.reset" in info.value.__notes__[0]
    assert trainer.state.global_step == 0 and agentic_threads() == []

    def divides(prompts, trainer):
        return 1 / 0

    trainer = rollout_func_trainer(tmp_path, model, tokenizer, prompt_dataset, divides)
    with pytest.raises(ZeroDivisionError) as info:
        trainer.train()
    assert "rollout_func ('divides')" in info.value.__notes__[0]
    assert agentic_threads() == []


def test_a_failure_of_the_generation_a_rollout_func_asks_for_stays_a_producer_error(
    tmp_path, tokenizer, model, prompt_dataset, monkeypatch
):
    from trl_a3po.rollout import InProcessBackend, ProducerError

    def broken(self, prompt_ids, stop):
        raise RuntimeError("the generator broke (injected)")

    monkeypatch.setattr(InProcessBackend, "generate", broken)
    trainer = rollout_func_trainer(tmp_path, model, tokenizer, prompt_dataset, two_turn_rollout([]))
    with pytest.raises(ProducerError, match="the generator broke") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert agentic_threads() == []
