"""The generation side: knows token ids, log-probs and policy versions, nothing of losses."""

from .backend import BackendContext, RolloutBackend, register_backend
from .continuous import ContinuousGenerationQueue
from .errors import ProducerError
from .inprocess import InProcessBackend, build_whole_snapshot, generate_with_behavior_logprobs
from .queue import (
    GeneratedBatch,
    GenerationQueue,
    GenerationResult,
    StalenessBound,
)


__all__ = [
    "BackendContext",
    "ContinuousGenerationQueue",
    "GeneratedBatch",
    "GenerationQueue",
    "GenerationResult",
    "InProcessBackend",
    "ProducerError",
    "RolloutBackend",
    "StalenessBound",
    "build_whole_snapshot",
    "register_backend",
    "generate_with_behavior_logprobs",
]
