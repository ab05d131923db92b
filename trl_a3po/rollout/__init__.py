"""The generation side: knows token ids, log-probs and policy versions, nothing of losses."""

from .inprocess import generate_with_behavior_logprobs

__all__ = ["generate_with_behavior_logprobs"]
