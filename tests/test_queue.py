"""The producer queue without a model: staleness bound, order, no loss, no deadlock, errors, shutdown."""

import random
import threading
import time

import pytest

from trl_a3po.rollout import GeneratedBatch, GenerationQueue, PolicyWeights, ProducerError, StalenessSchedule


class FakeBackend:
    """Generates 'completions' that echo the prompt, tagged with the version it read; sleeps at random."""

    def __init__(self, weights, rng, max_delay):
        self.weights, self.rng, self.max_delay = weights, rng, max_delay
        self.closed = False

    def generate(self, prompt_ids, min_version):
        with self.weights.reading() as (version, _):
            pass
        if self.max_delay and self.rng.random() < 0.5:
            time.sleep(self.rng.random() * self.max_delay)
        return GeneratedBatch([list(p) for p in prompt_ids], [[0.0] * len(p) for p in prompt_ids],
                              [version] * len(prompt_ids))

    def close(self):
        self.closed = True


def run_schedule(seed, max_delay=0.0005):
    """One random schedule: a fake trainer consumes batches micro-step by micro-step with random delays."""
    rng = random.Random(seed)
    accumulation = rng.randint(1, 4)
    micro = rng.randint(1, 6)  # steps_per_generation * num_iterations
    schedule_probe = StalenessSchedule(micro, accumulation, 0)
    in_batch = max(schedule_probe.last_train_step(k) - schedule_probe.first_train_step(k) for k in range(accumulation))
    eta = in_batch + rng.randint(0, 3)
    schedule = StalenessSchedule(micro, accumulation, eta)
    num_batches = rng.randint(1, 8)

    weights = PolicyWeights(lambda: {}, version=0)
    backend = FakeBackend(weights, random.Random(seed + 1), max_delay)
    queue = GenerationQueue(backend, weights)
    submitted, trained = 0, []
    step = 0
    try:
        for index in range(num_batches):
            while submitted <= min(schedule.submit_until(index), num_batches - 1):
                queue.submit(submitted, [[submitted, i] for i in range(3)], schedule.min_version(submitted))
                submitted += 1
            result = queue.get(index, timeout=10)
            assert result.index == index
            for micro_step in range(index * micro, (index + 1) * micro):
                assert micro_step // accumulation == step
                for version in result.batch.versions:
                    staleness = step - version
                    assert 0 <= staleness <= eta, (seed, index, step, version, eta)
                if rng.random() < 0.3:
                    time.sleep(rng.random() * max_delay)
                if (micro_step + 1) % accumulation == 0:  # optimizer step
                    weights.begin_update()
                    weights.end_update(step + 1)
                    step += 1
            trained.extend(tuple(p) for p in result.batch.completion_ids)
    finally:
        queue.close(timeout=10)
    expected = [(k, i) for k in range(num_batches) for i in range(3)]
    assert trained == expected, "a prompt was dropped, duplicated or reordered"
    assert backend.closed


def test_thousands_of_random_schedules_keep_the_bound_order_and_finish():
    start = time.perf_counter()
    for seed in range(2000):
        run_schedule(seed)
    assert time.perf_counter() - start < 120  # no schedule deadlocked (each get() has a 10 s timeout too)


def test_schedule_min_version_exact():
    # R = 3 micro-batches per generation batch, one micro-batch per optimizer step, eta = 3
    schedule = StalenessSchedule(micro_steps_per_batch=3, accumulation_steps=1, max_staleness=3)
    assert [schedule.last_train_step(k) for k in range(4)] == [2, 5, 8, 11]
    assert [schedule.min_version(k) for k in range(4)] == [0, 2, 5, 8]
    assert schedule.submit_until(0) == 1  # batch 1 may start once version 2 exists, during batch 0
    # R = 2 micro-batches over gradient_accumulation_steps = 4: two generation batches per optimizer step
    schedule = StalenessSchedule(2, 4, 1)
    assert [schedule.last_train_step(k) for k in range(4)] == [0, 0, 1, 1]
    assert [schedule.min_version(k) for k in range(6)] == [0, 0, 0, 0, 1, 1]


def test_producer_waits_instead_of_generating_too_stale():
    weights = PolicyWeights(lambda: {}, version=0)
    backend = FakeBackend(weights, random.Random(0), 0)
    queue = GenerationQueue(backend, weights)
    try:
        queue.submit(0, [[1]], min_version=2)
        with pytest.raises(TimeoutError):
            queue.get(0, timeout=0.3)  # nothing may be generated before version 2 exists
        assert queue.pending == 1
        for _ in range(2):
            weights.begin_update()
            weights.end_update()
        result = queue.get(0, timeout=5)
        assert result.batch.versions == [2]
        assert result.bound_wait_s >= 0.25
    finally:
        queue.close()


def test_producer_exception_surfaces_with_the_original_error():
    class Boom(Exception):
        pass

    class FailingBackend(FakeBackend):
        def generate(self, prompt_ids, min_version):
            raise Boom("generation exploded")

    weights = PolicyWeights(lambda: {})
    queue = GenerationQueue(FailingBackend(weights, random.Random(0), 0), weights)
    queue.submit(0, [[1]], 0)
    with pytest.raises(ProducerError, match="generation exploded") as info:
        queue.get(0, timeout=5)
    assert isinstance(info.value.__cause__, Boom)
    with pytest.raises(ProducerError):
        queue.raise_if_failed()
    queue.close()


def test_close_stops_a_producer_blocked_on_the_bound():
    weights = PolicyWeights(lambda: {})
    queue = GenerationQueue(FakeBackend(weights, random.Random(0), 0), weights)
    queue.submit(0, [[1]], min_version=10)  # can never be generated
    time.sleep(0.05)
    queue.close(timeout=5)
    assert not queue._thread.is_alive()
    assert threading.active_count() < 50


def test_submissions_must_be_in_order():
    weights = PolicyWeights(lambda: {})
    queue = GenerationQueue(FakeBackend(weights, random.Random(0), 0), weights)
    try:
        queue.submit(0, [[1]], 0)
        with pytest.raises(ValueError, match="in order: expected 1, got 2"):
            queue.submit(2, [[1]], 0)
    finally:
        queue.close()
