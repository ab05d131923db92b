"""The generation side: knows token ids, log-probs and policy versions, nothing of losses."""

from .inprocess import InProcessBackend, generate_with_behavior_logprobs
from .queue import GeneratedBatch, GenerationQueue, GenerationResult, PolicyWeights, ProducerError, RolloutBackend, StalenessSchedule

__all__ = [
    "GeneratedBatch",
    "GenerationQueue",
    "GenerationResult",
    "InProcessBackend",
    "PolicyWeights",
    "ProducerError",
    "RolloutBackend",
    "StalenessSchedule",
    "generate_with_behavior_logprobs",
]
