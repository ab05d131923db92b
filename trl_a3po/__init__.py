"""trl-a3po: asynchronous GRPO with A-3PO's staleness-aware proximal policy approximation, for TRL."""

from .config import A3POConfig
from .data import gsm8k_prompt, load_gsm8k
from .evaluation import GreedyEvalCallback, gsm8k_greedy_accuracy
from .models import resolve_model
from .rewards import extract_final_answer, gsm8k_accuracy_reward, gsm8k_format_reward
from .trainer import A3POTrainer

__all__ = [
    "A3POConfig",
    "A3POTrainer",
    "GreedyEvalCallback",
    "extract_final_answer",
    "gsm8k_accuracy_reward",
    "gsm8k_format_reward",
    "gsm8k_greedy_accuracy",
    "gsm8k_prompt",
    "load_gsm8k",
    "resolve_model",
]
__version__ = "0.1.0"
