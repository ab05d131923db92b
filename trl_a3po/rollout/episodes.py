"""Multi-turn episodes (TRL's tools and `environment_factory`) played by the producer, ahead of the trainer.

One `EpisodeRunner` per producer. For each generation batch the producer thread hands it the batch's dataset rows;
every row is an episode, played in a worker thread of its own (at most `max_concurrent_episodes` at once) by TRL's own
code: its prompt tokenization, `parse_response`, and `GRPOTrainer._tool_call_loop` (tool calls, results, `tool_mask`,
the truncation to `max_completion_length`, the call and failure counts). What runs there is TRL's, unchanged; what is
ours is small:
- `_EpisodeView`: the `self` TRL's methods run on. They read per-batch trainer state that the main thread rewrites
  while it scores an earlier batch (`_sync_tool_dicts`, `_batch_environments`, `environments`) and generate through
  `self._generate_single_turn`; the view gives each episode its own copy of the former and, for the latter, a turn
  request to the producer. Everything else it reads is the trainer's, read-only (a field TRL adds in a later release
  that the view does not know is an AttributeError naming it, never a silent read of main-thread state).
- the turn batcher (`run`, in the producer thread): the turns asked for while the generator was busy are generated
  together as one batch, so the backend (one model in-process, or a server) is driven by one thread, loads a newer
  version only between two generations, and every token records the version that sampled it.
- tools with a timeout, off the main thread: a sync tool runs in a daemon thread of its own, an async one on TRL's
  event loop under `asyncio.wait_for`; one that raises or exceeds `tool_timeout_s` is a failed call as TRL counts it
  (its error becomes the tool message). Episodes run concurrently, so their tool calls do.
- environments: the producer's own instances (`EnvironmentPool`), `reset` per episode as TRL does; each instance goes
  back to the pool once the trainer has scored its episode (rewards read it on the main thread).

Hand-written because TRL runs its tool loop on the trainer's main thread, one batch at a time, tools one after another
(`_tool_call_loop`); no library plays TRL episodes from a background producer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

from trl import GRPOTrainer
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational

from .backend import Generation
from .errors import EpisodesStopped, our_code, user_code


@dataclass
class Episode:
    """One row's episode, as the producer played it."""

    prompt: object  # the prompt as played: the row's, with the environment's `reset` observation appended
    prompt_ids: list[int]
    first_turn_ids: list[int]  # what the first generation sampled (TRL's `_generate` parses it)
    first_turn_logprobs: list[float]
    completion_ids: list[int]  # every turn, tool results included
    logprobs: list[float]  # per completion token: the behaviour log-prob (0.0 on tool-result tokens, as TRL)
    versions: list[int]  # per completion token: the version that sampled it (a tool token: its model token's before)
    tool_mask: list[int] | None  # 1 = model token, 0 = tool result (TRL's); None without tools
    completions: list  # the parsed messages (TRL's `completions` entry for this row)
    tool_calls: int = 0
    tool_failures: int = 0
    environment: object | None = None
    environment_name: str | None = None  # the row's `environment` (a dict of factories), else None
    observation: object | None = None  # what `reset` returned (None: nothing appended)
    tool_s: float = 0.0  # seconds this episode spent waiting for its tools
    # rollout_func: its output's other fields (`env_mask`, reward fields): this row's value of each per-row list
    # (those named in `rollout_fields_per_row`), the whole value of the others
    rollout_fields: dict | None = None
    rollout_fields_per_row: set | None = None


@dataclass
class _TurnAsk:
    prompt_ids: list[list[int]]
    answer: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


_WAKE = object()  # posted by `abort`: the batcher stops waiting
_EPISODE_ENDED = object()  # posted when a worker's episode ends (however it ends)


class EnvironmentPool:
    """The producer's environment instances, per environment name: handed out for an episode, given back once the
    trainer has scored it, created by the factory when none is free (TRL's "construct once, reset often", with as many
    instances as episodes in flight). The lock guards the free lists alone."""

    def __init__(self, factories: dict):
        self._factories = factories
        self._free = {name: [] for name in factories}
        self._lock = threading.Lock()

    def acquire(self, name):
        with self._lock:
            free = self._free[name]
            instance = free.pop() if free else None
        return instance if instance is not None else self._factories[name]()

    def release(self, name, instance) -> None:
        with self._lock:
            self._free[name].append(instance)


class EpisodeRunner:
    """Plays the episodes of one generation batch at a time, in the producer (see the module's docstring). Built on
    the trainer's main thread (it reads the trainer's tool and template settings there, once)."""

    def __init__(self, trainer, tool_timeout_s: float, max_concurrent: int):
        self._trainer = trainer
        self.tool_timeout_s = tool_timeout_s
        self.tools = list(trainer.tools or [])
        self._standalone_tools = list(trainer._standalone_tools or [])
        self.rollout_func = getattr(trainer, "_user_rollout_func", None)  # the user's, not the trainer's hook
        self._multi_environment = bool(getattr(trainer, "_multi_environment", False))
        factories = trainer.environment_factories
        # Instances of its own (TRL's pool stays the training thread's: evaluation resets and plays it there).
        self.environments = EnvironmentPool(factories) if factories is not None else None
        self._workers = concurrent.futures.ThreadPoolExecutor(max_concurrent, thread_name_prefix="a3po-episode")
        self._local = threading.local()  # per worker thread: its own copy of the tokenizer
        self._turns: queue.SimpleQueue | None = None  # the running batch's turn requests (workers -> producer)
        self._stopping = concurrent.futures.Future()  # done once `abort` is called: what every wait also waits for
        self._tool_threads: set[threading.Thread] = set()
        self._tool_threads_lock = threading.Lock()  # guards `_tool_threads` alone

    # ------------------------------------------------------------------ producer thread

    def run(self, rows: list[dict], generate_turn) -> list[Episode]:
        """Play every row's episode; `generate_turn(prompt_ids)` (called here, in the producer thread) generates one
        turn for several episodes at once and returns their `Generation` (ids, log-probs, versions). Raises
        `EpisodesStopped` once `abort` is called; re-raises the first error of an episode (user code included: `reset`,
        a factory)."""
        if self.rollout_func is not None:
            return self._run_rollout_func(rows, generate_turn)
        turns = self._turns = queue.SimpleQueue()
        futures = [self._workers.submit(self._play, row, turns) for row in rows]
        for future in futures:
            future.add_done_callback(lambda _: turns.put(_EPISODE_ENDED))
        ended, failed = 0, False
        while ended < len(futures):
            items = [turns.get()]
            while True:
                try:
                    items.append(turns.get_nowait())
                except queue.Empty:
                    break
            ended += sum(item is _EPISODE_ENDED for item in items)
            asks = [item for item in items if isinstance(item, _TurnAsk)]
            failed = failed or any(f.done() and f.exception() is not None for f in futures)
            if self._stopping.done() or failed:
                for ask in asks:
                    ask.answer.set_exception(EpisodesStopped())
                if self._stopping.done():
                    raise EpisodesStopped()
                continue  # an episode failed: let the others end (their next turn is refused), then raise
            if asks:
                self._answer(asks, generate_turn)
        return [future.result() for future in futures]  # raises the first failed episode's error

    @staticmethod
    def _answer(asks: list[_TurnAsk], generate_turn) -> None:
        try:
            generation = generate_turn([p for ask in asks for p in ask.prompt_ids])
        except BaseException as error:
            for ask in asks:
                ask.answer.set_exception(EpisodesStopped())
            raise error
        start = 0
        for ask in asks:
            end = start + len(ask.prompt_ids)
            ask.answer.set_result(generation[start:end])
            start = end

    def abort(self) -> None:
        """Stop: the batcher stops waiting, the workers stop at their next turn or tool wait (any thread)."""
        if not self._stopping.done():
            self._stopping.set_result(None)
        turns = self._turns
        if turns is not None:
            turns.put(_WAKE)

    def close(self, timeout: float = 10.0) -> None:
        """After `abort` (or between batches): end the workers; wait up to `timeout` s for tool calls still running
        (a sync tool cannot be interrupted), and name those that outlive it."""
        self.abort()
        self._workers.shutdown(wait=True, cancel_futures=True)
        with self._tool_threads_lock:
            running = list(self._tool_threads)
        deadline = time.monotonic() + timeout
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in running if t.is_alive()]
        if alive:
            warnings.warn(
                f"tool calls still running after training ended (daemon threads, left behind): {alive}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _run_rollout_func(self, rows: list[dict], generate_turn) -> list[Episode]:
        """A batch through the user's `rollout_func`, called here (the producer thread) as TRL calls it, with a view of
        the trainer whose `a3po_generate` generates with the version the producer holds: the one version every token
        of the batch gets (no version is loaded during the call). A rollout_func that generates elsewhere (its own
        server, TRL's vLLM client) cannot say which weights sampled its tokens: refused."""
        view = _RolloutFuncView(self, generate_turn)
        prompts = [copy.deepcopy(row["prompt"]) for row in rows]
        with user_code(f"rollout_func ({getattr(self.rollout_func, '__name__', self.rollout_func)!r})"):
            output = self.rollout_func(prompts, view)
            return self._episodes_of(rows, prompts, output, view)

    @staticmethod
    def _episodes_of(rows: list[dict], prompts: list, output: dict, view: _RolloutFuncView) -> list[Episode]:
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(output)
        if missing:
            raise ValueError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        if len(output["completion_ids"]) != len(rows):
            raise ValueError(
                f"rollout_func returned {len(output['completion_ids'])} completions for {len(rows)} prompts: with "
                "async_generation=True it must return one completion per prompt it is given (the prompts arrive "
                "repeated num_generations times, as the trainer's rows)."
            )
        masks = output.get("env_mask") or [[1] * len(ids) for ids in output["completion_ids"]]
        sampled = sum(map(sum, masks))  # model tokens (env_mask 1: TRL's tool_mask); the rest came from elsewhere
        if view.version is None or sampled > view.generated_tokens:
            raise ValueError(
                "with async_generation=True a rollout_func must generate through `trainer.a3po_generate(prompt_ids)`, "
                "which samples with the producer's weights and records their policy version: this one returned "
                f"{sampled} model tokens but generated {view.generated_tokens} that way (it calls another server or "
                "TRL's vLLM client, whose weights' version is unknown). Generate with `trainer.a3po_generate`, or set "
                "async_generation=False."
            )
        extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
        per_row = {k for k, v in extra.items() if isinstance(v, list) and len(v) == len(rows)}
        return [
            Episode(
                prompt=prompt,
                prompt_ids=list(prompt_ids),
                first_turn_ids=list(ids),
                first_turn_logprobs=list(logprobs),
                completion_ids=list(ids),
                logprobs=list(logprobs),
                versions=[view.version] * len(ids),
                tool_mask=None,
                completions=[],
                rollout_fields={k: (v[row] if k in per_row else v) for k, v in extra.items()},
                rollout_fields_per_row=per_row,
            )
            for row, (prompt, prompt_ids, ids, logprobs) in enumerate(
                zip(prompts, output["prompt_ids"], output["completion_ids"], output["logprobs"])
            )
        ]

    # ------------------------------------------------------------------ worker threads (one episode each)

    def _play(self, row: dict, turns: queue.SimpleQueue) -> Episode:
        view = _EpisodeView(self, turns)
        name = row.get("environment") if self._multi_environment else None
        environment, observation = None, None
        if self.environments is not None:
            # TRL's preamble (`_generate_and_score_completions`), for one row: its environment, reset with the row.
            with user_code(f"a dataset row's environment ({name!r})"):
                if self._multi_environment and name not in self._trainer.environment_factories:
                    raise ValueError(
                        f"Example has `environment={name!r}`, which is not among the environments passed to "
                        f"`environment_factory`. Expected one of: {list(self._trainer.environment_factories)}."
                    )
                environment = self.environments.acquire(name)  # the factory, the first time
            prompt = copy.deepcopy(row.get("prompt", [{"role": "user", "content": ""}]))
            reset_kwargs = {k: v for k, v in row.items() if k != "environment"} if self._multi_environment else row
            with user_code(f"the environment's reset ({type(environment).__name__}.reset)"):
                observation = environment.reset(**reset_kwargs)
            if observation is not None:
                prompt = with_observation(prompt, observation)
        else:
            prompt = copy.deepcopy(row["prompt"])
        view._batch_environments = [name]
        sync_tools, async_tools = self._tool_dicts(environment, view)
        view._sync_tool_dicts, view._async_tool_dicts = [sync_tools], [async_tools]  # TRL's, for a batch of one row
        prompt_ids = view._tokenize_prompts([prompt])[0][0]
        (first_ids,), (first_logprobs,) = view._generate_single_turn([prompt_ids], None, {}, 1)
        tools_here = view._env_tools[name] if self.environments is not None else self.tools
        tokenizer = view._tokenizer
        # TRL's `_generate` decoding of the first turn.
        parses = any(getattr(tokenizer, a, None) is not None for a in ("response_template", "response_schema"))
        text = tokenizer.decode(first_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompt}):
            completions = [
                [parse_response(tokenizer, first_ids, prefix=prompt_ids, tools=tools_here)]
                if parses
                else [{"role": "assistant", "content": text}]
            ]
        else:
            completions = [text]
        episode = Episode(
            prompt=prompt,
            prompt_ids=list(prompt_ids),
            first_turn_ids=list(first_ids),
            first_turn_logprobs=list(first_logprobs),
            completion_ids=list(first_ids),
            logprobs=list(first_logprobs),
            versions=[],
            tool_mask=None,
            completions=completions[0],
            environment=environment,
            environment_name=name,
            observation=observation,
        )
        if self.tools:
            # TRL's loop, for this one row (it mutates its arguments: hand it copies).
            tool_mask, completions, completion_ids, logprobs, calls, failures, _ = GRPOTrainer._tool_call_loop(
                view, [copy.deepcopy(prompt)], [list(prompt_ids)], [list(first_ids)], completions,
                [list(first_logprobs)], None, {},
            )  # fmt: skip
            episode.tool_mask, episode.completions = tool_mask[0], completions[0]
            episode.completion_ids, episode.logprobs = completion_ids[0], logprobs[0]
            episode.tool_calls, episode.tool_failures = calls, failures
        episode.versions = view.versions_of(episode.completion_ids, episode.tool_mask)
        episode.tool_s = view.tool_s
        return episode

    def tokenizer(self):
        """This worker thread's own tokenizer (a fast tokenizer is not safe to share between threads that encode)."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._trainer.processing_class)
        return tokenizer

    def _tool_dicts(self, environment, view: _EpisodeView) -> tuple[dict, dict]:
        """TRL's per-row tool dicts (standalone tools, plus the environment's public methods), each tool bounded by
        `tool_timeout_s` and run off the worker thread."""
        methods = []
        if environment is not None:
            methods = [
                getattr(environment, member)
                for member, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
                if member not in ("reset", "get_reward") and not member.startswith("_")
            ]
        sync_tools, async_tools = {}, {}
        for tool in self._standalone_tools + methods:
            if inspect.iscoroutinefunction(tool):
                async_tools[tool.__name__] = self._bounded_async(tool, view)
            else:
                sync_tools[tool.__name__] = self._bounded_sync(tool, view)
        return sync_tools, async_tools

    def _bounded_sync(self, tool, view: _EpisodeView):
        timeout = self.tool_timeout_s

        @functools.wraps(tool)
        def call(**kwargs):
            answer = concurrent.futures.Future()

            def target():
                try:
                    answer.set_result(tool(**kwargs))
                except BaseException as error:  # handed to the episode, which TRL's loop counts as a failed call
                    answer.set_exception(error)
                finally:
                    with self._tool_threads_lock:
                        self._tool_threads.discard(threading.current_thread())

            thread = threading.Thread(target=target, name=f"a3po-tool-{tool.__name__}", daemon=True)
            with self._tool_threads_lock:
                self._tool_threads.add(thread)
            start = time.perf_counter()
            thread.start()
            done, _ = concurrent.futures.wait([answer, self._stopping], timeout, concurrent.futures.FIRST_COMPLETED)
            view.tool_s += time.perf_counter() - start
            if answer in done:
                return answer.result()
            if self._stopping.done():
                raise EpisodesStopped()
            raise TimeoutError(f"tool {tool.__name__!r} did not return within {timeout} s")

        return call

    def _bounded_async(self, tool, view: _EpisodeView):
        timeout = self.tool_timeout_s

        @functools.wraps(tool)
        async def call(**kwargs):
            start = time.perf_counter()
            try:
                return await asyncio.wait_for(tool(**kwargs), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"tool {tool.__name__!r} did not return within {timeout} s") from None
            finally:
                view.tool_s += time.perf_counter() - start

        return call


class _EpisodeView:
    """The `self` TRL's tokenization and tool-loop methods run on, for one episode (see the module's docstring)."""

    # Read-only trainer fields TRL's `_tokenize_prompts`, `_get_tool_suffix_ids` and `_tool_call_loop` read.
    _SHARED = (
        "chat_template",
        "chat_template_kwargs",
        "_is_vlm",
        "tools",
        "environment_factories",
        "max_tool_calling_iterations",
        "max_completion_length",
        "async_loop",
    )

    def __init__(self, runner: EpisodeRunner, turns: queue.SimpleQueue):
        self._runner = runner
        self._turns = turns
        self._turn_log: list[Generation] = []  # each generated turn (one row: this episode's)
        self.tool_s = 0.0
        trainer = runner._trainer
        self.processing_class = self._tokenizer = runner.tokenizer()
        self._env_tools = getattr(trainer, "_env_tools", None)
        # TRL bounds a tool result by the context length (vLLM colocate: the engine's); the producer's generators
        # serve the policy's own.
        self.use_vllm, self.vllm_mode = False, None
        self.model = SimpleNamespace(config=trainer.model.config)
        self._batch_environments = self._sync_tool_dicts = self._async_tool_dicts = None  # set per episode

    def __getattr__(self, name):
        if name in _EpisodeView._SHARED:
            return getattr(self._runner._trainer, name)
        raise AttributeError(
            f"TRL's tool loop read the trainer's {name!r}, which the producer's episode view does not provide (a TRL "
            "release this A3POTrainer was not written for?). Set async_generation=False to run tools on the main "
            "thread."
        )

    _tokenize_prompts = GRPOTrainer._tokenize_prompts
    _get_tool_suffix_ids = GRPOTrainer._get_tool_suffix_ids

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """One turn of this episode: asked of the producer, which generates it with other episodes' turns."""
        ask = _TurnAsk([list(ids) for ids in prompt_ids])
        self._turns.put(ask)
        stopping = self._runner._stopping
        concurrent.futures.wait([ask.answer, stopping], return_when=concurrent.futures.FIRST_COMPLETED)
        if not ask.answer.done():
            raise EpisodesStopped()  # the producer has stopped: nobody will answer
        generation = ask.answer.result()  # EpisodesStopped when the producer refused it
        self._turn_log.append(generation)
        return generation.ids, generation.logprobs

    def versions_of(self, completion_ids: list[int], tool_mask: list[int] | None) -> list[int]:
        """Per completion token, the version that sampled it. The model tokens (tool_mask 1) are the turns' tokens in
        order, the last possibly cut by TRL to `max_completion_length` (a cut turn is always the last: nothing more
        fits); a tool token takes the version of the model token before it (it is never trained)."""
        turn_ids = [t for turn in self._turn_log for row in turn.ids for t in row]
        turn_versions = [v for turn in self._turn_log for row in turn.versions for v in row]
        mask = tool_mask if tool_mask is not None else [1] * len(completion_ids)
        model_ids = [t for t, m in zip(completion_ids, mask) if m]
        if model_ids != turn_ids[: len(model_ids)]:
            raise RuntimeError(
                "an episode's model tokens differ from what its turns generated: TRL's tool loop changed how it "
                "builds completions (a TRL release this A3POTrainer was not written for?)"
            )
        versions, model_token = [], 0
        for m in mask:
            if m:
                versions.append(turn_versions[model_token])
                model_token += 1
            else:
                versions.append(versions[-1] if versions else turn_versions[0])
        return versions


def with_observation(prompt: list, observation) -> list:
    """TRL's merge of a `reset` observation into the last message of a conversational prompt (a new list)."""
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


class _RolloutFuncView:
    """The trainer a `rollout_func` gets in the producer: `a3po_generate` samples with the producer's weights (one
    version for the whole call); every other attribute is the trainer's (read it, do not change it: the main thread
    trains meanwhile)."""

    def __init__(self, runner: EpisodeRunner, generate_turn):
        self._runner, self._generate_turn = runner, generate_turn
        self.version: int | None = None  # the version every token of this call was sampled with
        self.generated_tokens = 0

    def a3po_generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        with our_code():
            generation = self._generate_turn([list(p) for p in prompt_ids], switch=False)
        held = {v for row in generation.versions for v in row}
        self.version = next(iter(held), self.version)
        self.generated_tokens += generation.num_tokens
        return generation.ids, generation.logprobs

    @property
    def processing_class(self):
        return self._runner.tokenizer()

    def __getattr__(self, name):
        return getattr(self._runner._trainer, name)
