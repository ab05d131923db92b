"""Continuous generation: the next generation batches stream while the current one's tail finishes.

`GenerationQueue` generates one batch at a time, so a server drains at the end of every batch (its last sequences
run at a fraction of the batch size). Here the producer thread is a coordinator: every batch the staleness bound has
let in (submitted) streams in a thread of its own, at once, and the server batches them together; results still
leave in submission order. The rules that keep every token's version exact:
- a version is loaded (pushed) only while no stream runs. A batch the staleness bound keeps from the held version
  (its `min_version` is newer) waits until the running streams end, or, with in-flight weight updates, stops them
  between two tokens (they keep what they received) and they resume under the new version with those tokens. A newer
  version that is merely due (`sync_every`) is loaded when nothing streams, or, in flight, by stopping the streams;
  otherwise new batches start with the held version, which the bound allows, rather than wait;
- each stream tags its tokens with the version held when it started, which no load can change while it runs.
The backend's `generate_until` runs in the stream threads (several at once: a vLLM server handles concurrent
requests); `load` runs in the coordinator only. Every stream thread is joined before the coordinator returns, so
none outlives `close()`, and a stream's failure is raised by the coordinator like any producer failure.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from .queue import GeneratedBatch, GenerationQueue, GenerationResult, _Failure, _Request


@dataclass
class _Batch:
    """One submitted batch while it streams: its tokens so far, per row, and the stream working on it."""

    request: _Request
    idle_s: float
    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    unfinished: list[bool] = field(default_factory=list)
    started: float = 0.0
    sync_s: float = 0.0
    stream: threading.Thread | None = None
    answer: tuple | BaseException | None = None  # what the stream thread returned or raised

    def __post_init__(self):
        n = len(self.request.prompt_ids)
        self.ids, self.logprobs, self.versions = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        self.unfinished = [True] * n
        self.started = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.stream is None and not any(self.unfinished)


class ContinuousGenerationQueue(GenerationQueue):
    """A `GenerationQueue` whose submitted batches all stream at once (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        self._wake = threading.Event()  # set by submit, publish, close and every stream that ends
        self._pause = threading.Event()  # set: running streams stop between two tokens (a version must load)
        super().__init__(*args, **kwargs)

    def publish(self, version, named_tensors) -> None:
        super().publish(version, named_tensors)
        self._wake.set()

    def submit(self, index, prompt_ids, min_version) -> None:
        super().submit(index, prompt_ids, min_version)
        self._wake.set()

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        super().close(timeout)

    # -------------------------------------------------------------- producer thread: the coordinator

    def _run(self) -> None:
        batches: list[_Batch] = []  # submitted, not yet handed over; in submission order
        try:
            while not self._stop.is_set():
                self._wake.clear()  # cleared before looking, so a wake-up that comes while looking is not lost
                if not self._admit(batches):
                    return  # closed
                self._collect(batches)
                running = any(b.stream is not None for b in batches)
                waiting = [b for b in batches if b.stream is None and any(b.unfinished)]
                required = bool(waiting) and self._held_version < max(b.request.min_version for b in waiting)
                due = self._newer_version_due()
                if running and (required or (self._inflight and due)):
                    if self._inflight:
                        self._pause.set()  # the running streams stop at their next token; then the load
                    self._wake.wait()
                    continue
                if not running and (required or due):
                    seconds = self._load_weights_for(max((b.request.min_version for b in waiting), default=0))
                    self._pause.clear()
                    for batch in batches:
                        batch.sync_s += seconds
                for batch in waiting:
                    self._start_stream(batch)
                while batches and batches[0].done:
                    self._hand_over(batches.pop(0))
                self._wake.wait()
        except BaseException as error:  # re-raised in the trainer's thread by get() / raise_if_failed()
            self._error = error
            self._results.put(_Failure(error))
        finally:
            self._stop.set()  # the streams end at their next token
            for batch in batches:
                if batch.stream is not None:
                    batch.stream.join()

    def _admit(self, batches: list[_Batch]) -> bool:
        """Take every submitted request; block for one only when nothing streams. False once closed."""
        while True:
            idle_start = time.perf_counter()
            if batches:
                try:
                    request = self._requests.get_nowait()
                except queue.Empty:
                    return True
            else:
                request = self._requests.get()
            if request is None:
                return False
            batches.append(_Batch(request, time.perf_counter() - idle_start))

    def _collect(self, batches: list[_Batch]) -> None:
        """Fold in what every ended stream received; raise a stream's failure."""
        for batch in batches:
            if batch.stream is None or batch.stream.is_alive():
                continue
            batch.stream.join()
            batch.stream, answer, batch.answer = None, batch.answer, None
            if isinstance(answer, BaseException):
                raise answer
            rows, version, (new_ids, new_logprobs, unfinished) = answer
            for row, i in enumerate(rows):
                batch.ids[i] += new_ids[row]
                batch.logprobs[i] += new_logprobs[row]
                batch.versions[i] += [version] * len(new_ids[row])
                batch.unfinished[i] = unfinished[row]

    def _start_stream(self, batch: _Batch) -> None:
        rows = [i for i, unfinished in enumerate(batch.unfinished) if unfinished]
        prompts = [batch.request.prompt_ids[i] + batch.ids[i] for i in rows]
        version = self._held_version
        self._doing = f"generating batch {batch.request.index} with version {version}"
        # With in-flight updates a stream also stops when a newer version is due; without, it runs to its end.
        due = self._newer_version_due if self._inflight else (lambda: False)

        def stream():
            try:
                batch.answer = (rows, version, self._backend.generate_until(
                    prompts, self._stop, lambda: self._pause.is_set() or due(), [len(batch.ids[i]) for i in rows]))
            except BaseException as error:
                batch.answer = error
            finally:
                self._wake.set()

        batch.stream = threading.Thread(target=stream, name=f"a3po-stream-{batch.request.index}", daemon=True)
        batch.stream.start()

    def _hand_over(self, batch: _Batch) -> None:
        generated = GeneratedBatch(batch.ids, batch.logprobs, batch.versions,
                                   time.perf_counter() - batch.started - batch.sync_s, batch.sync_s)
        self._results.put(GenerationResult(batch.request.index, batch.request.prompt_ids, generated, batch.idle_s))

