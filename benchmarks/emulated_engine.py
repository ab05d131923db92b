"""An emulated generation engine, for measuring the trainer in the paper's regime on one GPU: generation on other GPUs
(a vLLM server), the training GPU the bottleneck. A benchmark backend, registered by name through
`trl_a3po.rollout.register_backend`; never a library default.

It uses no GPU: each `generate` waits tokens / rate seconds (on the stop event, so the end of training stops it at
once), then returns every row with exactly `max_completion_length` random tokens (never pad or EOS) and finite
behaviour log-probs, -log(vocabulary size): what a random model gives a random token, so behaviour weights stay near
1 and nothing is masked by the cap. New versions are accepted and ignored (the weight push is not emulated).
"""

from __future__ import annotations

import math
import random
import threading

from trl_a3po.rollout import RolloutBackend, register_backend


# Generated tokens per second of the engine, by default: the A-3PO paper's setup 1 as issue 45 reconstructs it from
# the H200 measurements (256 x 1,024 tokens per version in ~35 s of vLLM generation). Not a published vLLM figure: the
# one found for this model size is a serving benchmark's (methods.py --help says which); pass --engine-rate for yours.
DEFAULT_RATE = 7_500.0


class EmulatedEngine(RolloutBackend):
    serves_concurrent_requests = False

    def __init__(self, completion_tokens: int, vocab_size: int, eos_token_ids: list[int], rate: float):
        self.completion_tokens, self.rate = completion_tokens, rate
        self.tokens = [t for t in range(2, vocab_size) if t not in set(eos_token_ids)]
        self.logprob = -math.log(vocab_size)
        self.random = random.Random(0)
        self.generated_tokens = 0

    def stage(self, named_tensors):
        return None  # nothing copied: the engine holds no weights

    def load(self, staged) -> float:
        return 0.0

    def generate(self, prompt_ids: list[list[int]], stop: threading.Event):
        ids, logprobs, _ = self.generate_until(prompt_ids, stop, None, [0] * len(prompt_ids))
        return ids, logprobs

    def generate_until(self, prompt_ids, stop: threading.Event, interrupt, generated: list[int]):
        budgets = [self.completion_tokens - done for done in generated]
        stop.wait(sum(budgets) / self.rate)
        ids = [[self.random.choice(self.tokens) for _ in range(budget)] for budget in budgets]
        self.generated_tokens += sum(budgets)
        return ids, [[self.logprob] * len(row) for row in ids], [False] * len(ids)

    def close(self) -> None:
        pass


def register(rate: float = DEFAULT_RATE, name: str = "emulated") -> str:
    """Register the engine as `rollout_backend=name`, generating `rate` tokens per second."""

    def build(context):
        return EmulatedEngine(context.args.max_completion_length, context.vocab_size, context.eos_token_ids, rate)

    register_backend(name, build)
    return name
