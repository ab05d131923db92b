"""Timing on the training hot path without synchronising the device."""

from __future__ import annotations

import contextlib
import time

import torch


class ProxTimer:
    """Seconds spent obtaining proximal log-probs, without synchronising the device on the hot path: on CUDA each
    measurement records an event pair, read when the metric is logged (once per optimizer step, long after the
    events completed); elsewhere, the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list = []
        self._seconds = 0.0

    @contextlib.contextmanager
    def measure(self):
        if not self.cuda:
            start = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((start, end))

    def pop_seconds(self) -> float:
        seconds = self._seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
        self._events, self._seconds = [], 0.0
        return seconds
