"""Continuous generation: the next generation batches are generated while the current one's tail finishes.

`GenerationQueue` generates one batch at a time, so the generator drains at the end of every batch (its last sequences
run at a fraction of the batch size). Here the producer thread is a coordinator, and every batch the staleness bound
has let in (submitted) is generated at once, in one of two ways:
- a backend that serves concurrent requests (a vLLM server): each batch streams in a thread of its own and the
  server batches them together;
- a backend that runs one `generate` at a time (in-process): one stream holds the rows of every batch ready to
  start, so the batches that arrived while the last stream ran are generated as one (one tail instead of several).
  With in-flight weight updates the tail of a stopped stream joins the next batch's rows in the next stream (HF
  `generate` runs a static batch: the continued rows' keys and values are recomputed, which in flight they must be
  anyway, by the new weights).
Why no refill of finished rows without a version change: every batch the trainer submits after the first step needs
the version published just before it (`StalenessBound.last_submittable`), so it can never start under the version a
running stream holds; a new batch is ready only after a load, and loads wait for (or, in flight, stop) the streams.
Results still leave in submission order. The rules that keep every token's version exact:
- a version is loaded (pushed) only while no stream runs. A batch the staleness bound keeps from the held version
  (its `min_version` is newer) waits until the running streams end, or, with in-flight weight updates, stops them
  between two tokens (they keep what they received) and they resume under the new version with those tokens. A newer
  version that is merely due (`sync_every`) is loaded when a batch waits and nothing streams, or, in flight, by
  stopping the streams; otherwise new batches start with the held version, which the bound allows, rather than wait.
  Nothing is loaded for no batch: a version published after the run's last batch would cost a push nothing uses;
- each stream tags its tokens with the version held when it started, which no load can change while it runs.
The backend's `generate_until` runs in the stream threads; `load` runs in the coordinator only. Every stream thread is
joined before the coordinator returns, so none outlives `close()`, and a stream's failure is raised by the coordinator
like any producer failure.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field

from .backend import Generation
from .queue import GeneratedBatch, GenerationQueue, GenerationResult, _Failure, _Request


@dataclass
class _Batch:
    """One submitted batch until it is handed over: its tokens so far, per row, and the stream working on it. The
    coordinator's alone (streams never touch it: `_collect` folds a finished stream's answer in)."""

    request: _Request
    idle_s: float
    generation: Generation = field(init=False)  # the tokens so far, per row
    unfinished: list[bool] = field(default_factory=list)
    started: float = 0.0
    sync_s: float = 0.0
    stream: _Stream | None = None

    def __post_init__(self):
        self.generation = Generation.empty(len(self.request.prompt_ids))
        self.unfinished = [True] * len(self.request.prompt_ids)
        self.started = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.stream is None and not any(self.unfinished)


@dataclass
class _Stream:
    """One `generate_until` call, in a thread of its own, over `rows` ((batch, row) pairs) with one version."""

    rows: list[tuple[_Batch, int]]
    version: int
    thread: threading.Thread | None = None
    answer: tuple | BaseException | None = None  # written by the stream thread; read by the coordinator after join


class ContinuousGenerationQueue(GenerationQueue):
    """A `GenerationQueue` whose submitted batches are all generated at once (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._wake = threading.Event()  # set by submit, publish, close and every stream that ends
        self._pause = threading.Event()  # set: running streams stop between two tokens (a version must load)

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
                if running and self._inflight and (required or due):
                    self._pause.set()  # the running streams stop at their next token; then the load
                    self._wake.wait()
                    continue
                if not running and waiting and (required or due):  # a load with no batch to use it is wasted
                    seconds = self._load_weights_for(max(b.request.min_version for b in waiting))
                    self._pause.clear()
                    for batch in batches:
                        batch.sync_s += seconds
                ready = [b for b in waiting if b.request.min_version <= self._held_version]
                if ready and self._backend.serves_concurrent_requests:
                    for batch in ready:
                        self._start_stream([batch])
                elif ready and not running:
                    self._start_stream(ready)
                while batches and batches[0].done:
                    self._hand_over(batches.pop(0))
                self._wake.wait()
        except BaseException as error:  # re-raised in the trainer's thread by get() / raise_if_failed()
            self._error = error
            self._results.put(_Failure(error))
        finally:
            self._stop.set()  # the streams end at their next token
            for stream in _streams(batches):
                stream.thread.join()

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
        for stream in [s for s in _streams(batches) if not s.thread.is_alive()]:
            stream.thread.join()
            for batch, _ in stream.rows:
                batch.stream = None
            if isinstance(stream.answer, BaseException):
                raise stream.answer
            new_ids, new_logprobs, unfinished = stream.answer
            for row, (batch, i) in enumerate(stream.rows):
                batch.generation.extend_row(i, new_ids[row], new_logprobs[row], stream.version)
                batch.unfinished[i] = unfinished[row]

    def _start_stream(self, batches: list[_Batch]) -> None:
        stream = _Stream([(b, i) for b in batches for i, more in enumerate(b.unfinished) if more], self._held_version)
        prompts = [batch.request.prompt_ids[i] + batch.generation.ids[i] for batch, i in stream.rows]
        generated = [len(batch.generation.ids[i]) for batch, i in stream.rows]
        self._doing = f"generating batches {[b.request.index for b in batches]} with version {stream.version}"
        # With in-flight updates a stream also stops when a newer version is due; without, it runs to its end. The
        # stream thread compares with its own version: `_held_version` is the coordinator's.
        due = functools.partial(self._newer_version_due, stream.version) if self._inflight else (lambda: False)

        def interrupt() -> bool:
            return self._pause.is_set() or due()

        def generate():
            try:
                stream.answer = self._backend.generate_until(prompts, self._stop, interrupt, generated)
            except BaseException as error:
                stream.answer = error
            finally:
                self._wake.set()

        stream.thread = threading.Thread(target=generate, name=f"a3po-stream-{batches[0].request.index}", daemon=True)
        for batch in batches:
            batch.stream = stream
        stream.thread.start()

    def _hand_over(self, batch: _Batch) -> None:
        generated = GeneratedBatch(batch.generation, time.perf_counter() - batch.started - batch.sync_s, batch.sync_s)
        self._results.put(GenerationResult(batch.request.index, batch.request.prompt_ids, generated, batch.idle_s))


def _streams(batches: list[_Batch]) -> list[_Stream]:
    """The distinct streams working on `batches` (in-process, one stream holds several batches)."""
    return list({id(b.stream): b.stream for b in batches if b.stream is not None}.values())
