"""trl-a3po: asynchronous GRPO with A-3PO's staleness-aware proximal policy approximation, for TRL.

The names below load on first use (PEP 562), so `import trl_a3po.proximal` (the math, torch only) works where TRL is
not installed: the GPU check (benchmarks/gpu_check.sh) runs on a machine that has only torch and transformers.
"""

import importlib


_EXPORTS = {
    "A3POConfig": ".config",
    "A3POTrainer": ".trainer",
    "GreedyEvalCallback": ".evaluation",
    "extract_final_answer": ".rewards",
    "gsm8k_accuracy_reward": ".rewards",
    "gsm8k_correct_format_reward": ".rewards",
    "gsm8k_format_reward": ".rewards",
    "gsm8k_greedy_accuracy": ".evaluation",
    "gsm8k_prompt": ".data",
    "load_gsm8k": ".data",
    "resolve_model": ".models",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trl_a3po' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
