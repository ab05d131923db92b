"""The producer queue without a model: staleness bound, order, no loss, no deadlock, errors, shutdown."""

import linecache
import random
import sys
import threading
import time

import pytest

from trl_a3po.rollout import ContinuousGenerationQueue, GenerationQueue, ProducerError, StalenessBound


class FakeBackend:
    """'Completions' that echo the prompt; the weights are {"version": v}, so every sample shows which version the
    producer loaded before generating it. Sleeps at random; can be made to block until stopped."""

    serves_concurrent_requests = True

    def __init__(self, rng=None, max_delay=0.0):
        self.rng, self.max_delay = rng or random.Random(0), max_delay
        self.loaded = None
        self.loads = []
        self.closed = False
        self.block = False
        self.generating = threading.Event()  # set when a generation starts

    def stage(self, tensors):
        return dict(tensors)

    def load(self, tensors):
        self.loaded = tensors["version"]
        self.loads.append(self.loaded)
        return 0.0

    def generate(self, prompt_ids, stop):
        self.generating.set()
        if self.max_delay and self.rng.random() < 0.5:
            time.sleep(self.rng.random() * self.max_delay)  # a random schedule, not a wait
        if self.block:
            stop.wait()  # a generation that only the stop event ends
        return [list(p) + [self.loaded] for p in prompt_ids], [[0.0] * (len(p) + 1) for p in prompt_ids]

    def generate_until(self, prompt_ids, stop, interrupt, generated):  # what ContinuousGenerationQueue calls
        ids, logprobs = self.generate(prompt_ids, stop)
        return ids, logprobs, [False] * len(ids)

    def close(self):
        self.closed = True


def weights(version):
    return {"version": version}


def wait_until_the_producer_waits_for_work(queue, timeout=10.0):
    """Until the producer thread has looked at everything done so far and waits for more: read from its own stack
    (its `_run` at the line that blocks on the next request or wake-up, with no wake-up pending), not guessed with a
    sleep."""
    deadline = time.monotonic() + timeout
    poll = threading.Event()
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(queue._thread.ident)
        while frame is not None and frame.f_code.co_name not in ("_run", "_admit"):
            frame = frame.f_back
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno) if frame is not None else ""
        if "self._requests.get()" in line:  # blocked until a request comes: nothing else can wake it
            return
        if "self._wake.wait()" in line and not queue._wake.is_set():  # (continuous) no wake-up left unseen
            return
        poll.wait(0.001)  # a condition the producer's own stack shows, read again
    raise TimeoutError(f"the producer did not come to wait for work in {timeout} s")


def drive_like_the_trainer(queue, bound, num_batches, rows):
    """Drive the queue as A3POTrainer does: at the start of training step k, publish version k, submit every batch
    the bound allows (batch j's prompts are [j, i] for i < rows), take batch k; yields (k, batch k's result)."""
    submitted = 0
    for version in range(num_batches):
        queue.publish(version, weights(version))
        while submitted <= min(bound.last_submittable(version), num_batches - 1):
            queue.submit(submitted, [[submitted, i] for i in range(rows)], bound.min_version(submitted))
            submitted += 1
        yield version, queue.get(version, timeout=10)


def run_schedule(seed, max_delay=0.0005):
    """One random schedule, driven like A3POTrainer drives the queue: at the start of training step k, publish
    version k, submit what the bound allows, take batch k, then run the step's optimizer steps (random delays)."""
    rng = random.Random(seed)
    eta = rng.randint(0, 4)
    optimizer_steps_per_version = rng.randint(1, 4)
    num_batches = rng.randint(1, 10)
    sync_every = rng.randint(1, 3)
    bound = StalenessBound(eta)
    backend = FakeBackend(random.Random(seed + 1), max_delay)
    queue = GenerationQueue(backend, sync_every=sync_every).start()
    trained = []
    try:
        for version, result in drive_like_the_trainer(queue, bound, num_batches, rows=3):
            assert result.index == version
            for ids, behaviour in zip(result.batch.generation.ids, result.batch.generation.versions):
                # every token's recorded version is the version the backend had loaded
                assert behaviour == [ids[-1]] * len(ids)
                assert 0 <= version - ids[-1] <= eta, (seed, version, behaviour, eta)
            for _ in range(optimizer_steps_per_version):
                if rng.random() < 0.3:
                    time.sleep(rng.random() * max_delay)
            trained.extend(tuple(ids[:-1]) for ids in result.batch.generation.ids)
    finally:
        queue.close(timeout=10)
    expected = [(k, i) for k in range(num_batches) for i in range(3)]
    assert trained == expected, "a prompt was dropped, duplicated or reordered"
    assert backend.loads == sorted(set(backend.loads)), "a version was loaded twice or out of order"
    assert backend.closed and not queue._thread.is_alive()


def test_thousands_of_random_schedules_keep_the_bound_order_and_finish():
    for seed in range(2000):
        run_schedule(seed)  # each get() has a 10 s timeout: a deadlock fails the test


def test_bound_exact():
    bound = StalenessBound(max_staleness=2)
    assert [bound.min_version(k) for k in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [bound.last_submittable(v) for v in range(3)] == [2, 3, 4]
    synchronous = StalenessBound(0)
    assert [synchronous.min_version(k) for k in range(3)] == [0, 1, 2]
    assert synchronous.last_submittable(5) == 5


@pytest.mark.parametrize("queue_class", [GenerationQueue, ContinuousGenerationQueue])
def test_stale_weights_are_loaded_only_when_the_bound_or_sync_every_needs_them(queue_class):
    backend = FakeBackend()
    queue = queue_class(backend, sync_every=3).start()
    try:
        queue.publish(0, weights(0))
        queue.submit(0, [[0]], min_version=0)
        assert queue.get(0, timeout=5).batch.generation.versions == [[0, 0]]
        queue.publish(1, weights(1))
        queue.submit(1, [[1]], min_version=0)  # version 0 is allowed and only 1 behind: no load
        assert queue.get(1, timeout=5).batch.generation.versions == [[0, 0]]
        queue.publish(2, weights(2))
        queue.submit(2, [[2]], min_version=2)  # the bound needs version 2
        assert queue.get(2, timeout=5).batch.generation.versions == [[2, 2]]
        for version in (3, 4, 5):
            queue.publish(version, weights(version))
        queue.submit(3, [[3]], min_version=0)  # 3 versions behind the newest: sync_every=3 loads it
        assert queue.get(3, timeout=5).batch.generation.versions == [[5, 5]]
        assert backend.loads == [0, 2, 5]
        for version in (6, 7, 8):  # due by sync_every, but no batch waits: a load now would be a wasted push
            queue.publish(version, weights(version))
        wait_until_the_producer_waits_for_work(queue)  # it has seen version 8
        assert backend.loads == [0, 2, 5]
        queue.submit(4, [[4]], min_version=0)
        assert queue.get(4, timeout=5).batch.generation.versions == [[8, 8]]
        assert backend.loads == [0, 2, 5, 8]
    finally:
        queue.close()


def test_submitting_before_the_version_exists_is_refused():
    queue = GenerationQueue(FakeBackend()).start()
    try:
        with pytest.raises(ValueError, match=r"batch 0 needs version >= 0, but the newest published is None"):
            queue.submit(0, [[1]], min_version=0)
        queue.publish(0, weights(0))
        with pytest.raises(ValueError, match=r"batch 0 needs version >= 1, but the newest published is 0"):
            queue.submit(0, [[1]], min_version=1)
        with pytest.raises(ValueError, match=r"increasing order: 0 after 0"):
            queue.publish(0, weights(0))
    finally:
        queue.close()


@pytest.mark.parametrize("queue_class", [GenerationQueue, ContinuousGenerationQueue])
def test_producer_exception_surfaces_with_the_original_error(queue_class):
    class Boom(Exception):
        pass

    class FailingBackend(FakeBackend):
        def generate(self, prompt_ids, stop):
            raise Boom("generation exploded")

    queue = queue_class(FailingBackend()).start()
    queue.publish(0, weights(0))
    queue.submit(0, [[1]], 0)
    with pytest.raises(ProducerError, match="generation exploded") as info:
        queue.get(0, timeout=5)
    assert isinstance(info.value.__cause__, Boom)
    with pytest.raises(ProducerError):
        queue.raise_if_failed()
    with pytest.raises(ProducerError):  # every later call re-raises, none blocks
        queue.get(1, timeout=5)
    queue.close()
    assert not queue._thread.is_alive()


@pytest.mark.parametrize("queue_class", [GenerationQueue, ContinuousGenerationQueue])
@pytest.mark.parametrize("state", ["idle", "mid-generation"])
def test_close_stops_the_producer_promptly(state, queue_class):
    backend = FakeBackend()
    queue = queue_class(backend).start()
    if state == "mid-generation":
        backend.block = True  # a generation that only the stop event ends
        queue.publish(0, weights(0))
        queue.submit(0, [[1]], 0)
        assert backend.generating.wait(5)
    start = time.perf_counter()
    queue.close(timeout=5)
    assert time.perf_counter() - start < 1.0
    assert not queue._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("a3po-stream")]
    assert backend.closed


def test_batches_are_submitted_and_taken_in_order():
    queue = GenerationQueue(FakeBackend()).start()
    try:
        queue.publish(0, weights(0))
        queue.submit(0, [[1]], 0)
        with pytest.raises(ValueError, match="in order: expected 1, got 2"):
            queue.submit(2, [[1]], 0)
        with pytest.raises(KeyError, match="batch 1 was never submitted"):
            queue.get(1, timeout=1)
        assert queue.get(0, timeout=5).index == 0
        with pytest.raises(ValueError, match="taken in order: expected 1, got 0"):
            queue.get(0, timeout=1)  # taking a batch twice is an error, not an endless wait
    finally:
        queue.close()


def test_the_trainer_never_blocks_the_producer_outside_a_reference_swap():
    # The lock guards one reference: a publish in progress on the trainer's side (staging a large model) must not
    # hold it while staging.
    staged = threading.Event()
    release = threading.Event()

    class SlowStage(FakeBackend):
        def stage(self, tensors):
            staged.set()
            release.wait(5)
            return dict(tensors)

    backend = SlowStage()
    queue = GenerationQueue(backend).start()
    try:
        publisher = threading.Thread(target=queue.publish, args=(0, weights(0)))
        publisher.start()
        assert staged.wait(5)
        assert queue._weights_lock.acquire(timeout=1)  # free while the trainer stages
        queue._weights_lock.release()
        release.set()
        publisher.join(5)
        assert queue.published_version == 0
    finally:
        release.set()
        queue.close()


def test_close_leaves_the_backend_open_under_a_producer_that_does_not_stop():
    # A producer stuck inside a server call that ignores the stop event: closing the backend under it would pull its
    # connection away mid-call. close() warns, naming what the producer is doing, and leaves the backend alone.
    release = threading.Event()

    class Stuck(FakeBackend):
        def generate(self, prompt_ids, stop):
            self.generating.set()
            release.wait(30)
            return super().generate(prompt_ids, stop)

    backend = Stuck()
    queue = GenerationQueue(backend).start()
    queue.publish(0, weights(0))
    queue.submit(0, [[1]], min_version=0)
    assert backend.generating.wait(5)  # the producer is inside generate
    with pytest.warns(RuntimeWarning, match=r"did not stop within 0.5 s \(it is generating batch 0 with version 0\)"):
        queue.close(timeout=0.5)
    assert not backend.closed
    release.set()


def test_an_error_closing_the_queue_never_replaces_the_error_that_ended_training(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    from testing_utils import make_trainer

    from trl_a3po.rollout import InProcessBackend

    def failing_close(self):
        raise OSError("closing the backend failed too")

    def failing_step(*args, **kwargs):
        raise RuntimeError("the error that ended training")

    monkeypatch.setattr(InProcessBackend, "close", failing_close)
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, max_steps=2)
    monkeypatch.setattr(trainer, "_compute_loss", failing_step)
    with (
        pytest.warns(RuntimeWarning, match="closing the generation queue also failed: OSError"),
        pytest.raises(RuntimeError, match="the error that ended training"),
    ):
        trainer.train()


class TokenByTokenBackend:
    """Samples one token at a time, each token the version loaded when it was sampled, and answers the queue's
    `generate_until`: stops between two tokens once `interrupt()` says so. Each prompt's
    completion has its own length (3 to 8 tokens, a function of the prompt), so batches have a tail. A server serves
    concurrent requests; an in-process generator (`concurrent=False`) must never be asked for two at once."""

    max_new_tokens = 8

    def __init__(self, rng, concurrent=True, token_delay=0.0005):
        self.rng, self.serves_concurrent_requests, self.token_delay = rng, concurrent, token_delay
        self.loaded = None
        self._lock = threading.Lock()  # several streams at once under ContinuousGenerationQueue
        self.streaming = self.most_streaming = self.most_batches_in_a_call = self.continued_calls = 0

    @staticmethod
    def length(prompt):
        return 3 + (7 * prompt[0] + 3 * prompt[1]) % 6

    def stage(self, named_tensors):
        return dict(named_tensors)

    def load(self, staged):
        assert self.streaming == 0, "a version was loaded while a generation was running"
        self.loaded = staged["version"]
        return 0.0

    def generate_until(self, prompt_ids, stop, interrupt, generated):
        with self._lock:
            self.streaming += 1
            self.most_streaming = max(self.most_streaming, self.streaming)
            assert self.serves_concurrent_requests or self.streaming == 1, "two generations at once in-process"
        self.most_batches_in_a_call = max(self.most_batches_in_a_call, len({p[0] for p in prompt_ids}))
        self.continued_calls += any(generated)  # rows stopped part-way (a version switch or a refill) go on
        # prompt = [batch, row] + the tokens generated before; each row stops at its own length
        wanted = [self.length(p) - done for p, done in zip(prompt_ids, generated)]
        assert all(len(p) == 2 + done for p, done in zip(prompt_ids, generated)) and min(wanted) > 0
        ids = [[] for _ in prompt_ids]
        try:
            for _ in range(max(wanted)):
                time.sleep(self.rng.random() * self.token_delay)
                for row, want in zip(ids, wanted):
                    if len(row) < want:
                        row.append(self.loaded)
                if stop.is_set() or interrupt():
                    break
        finally:
            with self._lock:
                self.streaming -= 1
        return ids, [[0.0] * len(row) for row in ids], [len(row) < want for row, want in zip(ids, wanted)]

    def close(self):
        pass


@pytest.mark.parametrize(
    "queue_class,inflight,server",
    [
        (GenerationQueue, True, False),
        (ContinuousGenerationQueue, False, True),
        (ContinuousGenerationQueue, True, True),
        (ContinuousGenerationQueue, False, False),
        (ContinuousGenerationQueue, True, False),
    ],
)
def test_inflight_and_continuous_schedules_keep_every_token_on_its_version_within_the_bound_and_in_order(
    queue_class, inflight, server
):
    # Random schedules as in run_schedule. In-flight updates: a sequence may mix versions. Continuous generation:
    # several batches at once, as concurrent requests (a server) or merged into one generation whose finished rows
    # are refilled (in-process). Either way every token carries the version that sampled it, none is older than the
    # bound allows, no version loads while a generation runs, and batches come back whole and in order.
    mixed = concurrent = merged = continued = 0
    for seed in range(200):
        rng = random.Random(seed)
        eta, num_batches = rng.randint(0, 3), rng.randint(2, 8)
        # the trainer faster or slower than the generator: in the second case the generator falls behind
        token_delay, step_delay = rng.choice([(0.0005, 0.002), (0.002, 0.0002)])
        backend = TokenByTokenBackend(random.Random(seed + 1), server, token_delay)
        bound = StalenessBound(eta)
        queue = queue_class(backend, inflight_weight_updates=inflight).start()
        try:
            for version, result in drive_like_the_trainer(queue, bound, num_batches, rows=4):
                assert result.prompt_ids == [[version, i] for i in range(4)]
                for prompt, ids, behaviour in zip(
                    result.prompt_ids, result.batch.generation.ids, result.batch.generation.versions
                ):
                    assert len(ids) == backend.length(prompt)  # whole: tokens before and after each stop, none lost
                    assert behaviour == ids  # each token's recorded version is the one that sampled it
                    assert behaviour == sorted(behaviour)  # versions only move forward within a sequence
                    assert all(version - eta <= v <= version for v in behaviour), (seed, version, behaviour, eta)
                    mixed += len(set(behaviour)) > 1
                time.sleep(rng.random() * step_delay)
        finally:
            queue.close(timeout=10)
        assert not queue._thread.is_alive()
        assert not [t for t in threading.enumerate() if t.name.startswith("a3po-stream")]  # every stream joined
        concurrent += backend.most_streaming > 1
        merged += backend.most_batches_in_a_call > 1
        continued += backend.continued_calls
    continuous = queue_class is ContinuousGenerationQueue
    assert (mixed > 0) == inflight  # the schedules did switch mid-sequence (and only in flight)
    assert (concurrent > 0) == (continuous and server)  # several batches streamed at once
    assert (merged > 0) == (continuous and not server)  # one generation held rows of several batches
    assert (continued > 0) == inflight  # rows stopped part-way went on (only in flight: no stop without a version)
