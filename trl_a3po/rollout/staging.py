"""A published version's private copy, and the CUDA ordering between the thread that copies and the one that reads.

The trainer's main thread stages (copies) the weights on its own CUDA stream; the producer thread loads or pushes
them on another stream. Without an event between the two, the producer could read a copy that is not finished, and
the caching allocator could hand the copy's memory to the trainer while the producer still reads it. `StagedWeights`
carries that event; `wait_until_staged` makes the reading stream wait for it and marks the tensors as used there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass
class StagedWeights:
    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None  # recorded on the staging stream after the last copy; None off CUDA


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def as_pairs(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a mapping or from pairs (a source that gathers shards one at a time yields pairs)."""
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def stage_copy(named_tensors: NamedTensors, copy: Callable[[torch.Tensor], torch.Tensor]) -> StagedWeights:
    """Copy every tensor with `copy` (on the calling thread's current stream) as it comes, and record when the copies
    are done. Taking each tensor as it comes lets the source gather sharded parameters one at a time."""
    with torch.no_grad():
        staged = {name: copy(tensor.detach()) for name, tensor in as_pairs(named_tensors)}
    ready = None
    if any(t.is_cuda for t in staged.values()):
        ready = torch.cuda.Event()
        ready.record()
    return StagedWeights(staged, ready)


def wait_until_staged(staged: StagedWeights) -> None:
    """On the reading thread: order its current stream after the copies, and keep their memory from being reused
    before the work this stream queues on them has run."""
    if staged.ready is None:
        return
    stream = torch.cuda.current_stream()
    stream.wait_event(staged.ready)
    for tensor in staged.tensors.values():
        if tensor.is_cuda:
            tensor.record_stream(stream)
