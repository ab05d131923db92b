"""trl-a3po: asynchronous GRPO with A-3PO's staleness-aware proximal policy approximation, for TRL."""

from .config import A3POConfig
from .trainer import A3POTrainer

__all__ = ["A3POConfig", "A3POTrainer"]
__version__ = "0.1.0"
