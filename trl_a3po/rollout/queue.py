"""The staleness-bounded generation queue: a producer thread that generates batches ahead of the trainer.

It knows token ids, policy versions and nothing of losses or of TRL. The trainer (main thread) submits requests in
the synchronous prompt order, each with the oldest policy version allowed to generate it (`min_version`, from the
staleness bound), publishes a new version after every optimizer step, and takes results back in order. The producer
never drops anything: when the next request would need weights newer than the trainer has, it waits (backpressure).

Hand-written because neither TRL nor Accelerate has a bounded-staleness producer for GRPOTrainer: TRL's experimental
async trainer drops stale samples instead, and is its own trainer.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


class PolicyWeights:
    """The trainer's live weights, shared with the producer.

    The trainer holds `updating()` around each optimizer step (weights change only there) and bumps the version;
    the producer reads inside `reading()`, so it never sees a half-updated model and always knows which version it
    read. `tensors_fn` returns the current weights as HF-named tensors (merged, for LoRA).
    """

    def __init__(self, tensors_fn: Callable[[], dict], version: int = 0):
        self._tensors_fn = tensors_fn
        self._lock = threading.Lock()
        self._changed = threading.Condition(threading.Lock())
        self.version = version

    def begin_update(self):
        """Called before the weights change (the optimizer step); `end_update` after it."""
        self._lock.acquire()

    def end_update(self, new_version: int | None = None):
        """Publish the updated weights as `new_version` (default: one more) and wake the producer."""
        with self._changed:
            self.version = self.version + 1 if new_version is None else new_version
            self._changed.notify_all()
        self._lock.release()

    def set_version(self, version: int):
        """Jump to a version (resume from a checkpoint) without an update."""
        with self._changed:
            self.version = version
            self._changed.notify_all()

    @contextlib.contextmanager
    def updating(self):
        self.begin_update()
        try:
            yield
        finally:
            self.end_update()

    @contextlib.contextmanager
    def reading(self) -> Iterator[tuple[int, dict]]:
        with self._lock:
            yield self.version, self._tensors_fn()

    def wait_for(self, version: int, stop: threading.Event, poll_s: float = 0.05) -> float:
        """Block until the weights reach `version` (or `stop` is set); return the seconds waited."""
        start = time.perf_counter()
        with self._changed:
            while self.version < version and not stop.is_set():
                self._changed.wait(poll_s)
        return time.perf_counter() - start


class RolloutBackend(Protocol):
    """What the producer drives: it generates with weights of at least `min_version` and says which version."""

    def generate(self, prompt_ids: list[list[int]], min_version: int) -> GeneratedBatch: ...

    def close(self) -> None: ...


@dataclass
class GeneratedBatch:
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[int]  # per sample: the policy version of the weights that generated it
    generation_s: float = 0.0
    weight_sync_s: float = 0.0


@dataclass
class GenerationResult:
    index: int
    prompt_ids: list[list[int]]
    batch: GeneratedBatch
    bound_wait_s: float  # producer time spent waiting for the trainer (the staleness bound)
    extras: dict = field(default_factory=dict)


@dataclass
class _Request:
    index: int
    prompt_ids: list[list[int]]
    min_version: int


class ProducerError(RuntimeError):
    """The producer thread failed; the original exception is the `__cause__`."""


class GenerationQueue:
    """A background producer of generation batches, in submission order, under a staleness bound."""

    def __init__(self, backend: RolloutBackend, weights: PolicyWeights, name: str = "a3po-producer"):
        self._backend = backend
        self._weights = weights
        self._cond = threading.Condition()
        self._requests: collections.deque[_Request] = collections.deque()
        self._results: dict[int, GenerationResult] = {}
        self._next_submit = None  # index the next request must carry (order check)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- trainer side (main thread)

    def submit(self, index: int, prompt_ids: list[list[int]], min_version: int) -> None:
        self.raise_if_failed()
        with self._cond:
            if self._next_submit is not None and index != self._next_submit:
                raise ValueError(f"generation batches must be submitted in order: expected {self._next_submit}, "
                                 f"got {index}")
            self._next_submit = index + 1
            self._requests.append(_Request(index, prompt_ids, max(min_version, 0)))
            self._cond.notify_all()

    def get(self, index: int, timeout: float | None = None) -> GenerationResult:
        """Block until batch `index` is generated; re-raise the producer's error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while index not in self._results:
                self._raise_locked()
                if self._stop.is_set():
                    raise RuntimeError("the generation queue is closed")
                if index not in self._results and not self._pending_locked(index):
                    raise KeyError(f"generation batch {index} was never submitted")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"generation batch {index} not ready after {timeout} s")
                self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))
            return self._results.pop(index)

    def raise_if_failed(self) -> None:
        with self._cond:
            self._raise_locked()

    @property
    def depth(self) -> int:
        """Generated batches waiting for the trainer."""
        with self._cond:
            return len(self._results)

    @property
    def pending(self) -> int:
        """Requests not yet generated."""
        with self._cond:
            return len(self._requests)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer (a batch mid-generation is finished first) and release the backend."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._backend.close()

    # -------------------------------------------------------------- producer thread

    def _pending_locked(self, index: int) -> bool:
        return any(r.index == index for r in self._requests) or (
            self._next_submit is not None and index < self._next_submit
        )

    def _raise_locked(self) -> None:
        if self._error is not None:
            raise ProducerError(f"the generation producer failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while not self._requests and not self._stop.is_set():
                        self._cond.wait(0.1)
                    if self._stop.is_set():
                        return
                    request = self._requests[0]
                # Backpressure: generating with older weights would break the staleness bound.
                bound_wait_s = self._weights.wait_for(request.min_version, self._stop)
                if self._stop.is_set():
                    return
                batch = self._backend.generate(request.prompt_ids, request.min_version)
                if min(batch.versions) < request.min_version:
                    raise AssertionError(
                        f"backend generated batch {request.index} with version {min(batch.versions)} < "
                        f"min_version {request.min_version}"
                    )
                with self._cond:
                    self._requests.popleft()
                    self._results[request.index] = GenerationResult(
                        request.index, request.prompt_ids, batch, bound_wait_s
                    )
                    self._cond.notify_all()
        except BaseException as error:  # surfaced in the trainer's thread by get() / raise_if_failed()
            with self._cond:
                self._error = error
                self._cond.notify_all()
