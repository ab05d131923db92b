"""A3POConfig: GRPOConfig plus the knobs of the decoupled loss and the proximal policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

PROX_LOGP_METHODS = ("loglinear", "recompute", "metrics")
# Loss types whose per-token objective is the clipped surrogate min(r*A, clip(r)*A); they differ only in how tokens
# are aggregated, so the decoupled loss can keep TRL's aggregation for each of them.
DECOUPLED_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


@dataclass
class A3POConfig(GRPOConfig):
    r"""
    Configuration for [`A3POTrainer`]: everything of [`trl.GRPOConfig`], plus the decoupled PPO loss of A-3PO
    (arXiv 2512.06547).

    With `use_decoupled_loss=True` each token's loss is `-w * min(r*A, clip(r)*A)` with the behaviour weight
    `w = pi_prox / pi_behav` and the trust-region ratio `r = pi_theta / pi_prox`. `prox_logp_method` chooses how
    `pi_prox` is obtained: interpolated between the behaviour and current policies (`loglinear`, A-3PO, free), or
    by a no-grad forward pass of the current policy per generation batch (`recompute`, decoupled PPO).
    """

    prox_logp_method: str = field(
        default="loglinear",
        metadata={
            "help": "How the proximal log-probs are obtained. `loglinear` (A-3PO): per token, "
            "alpha*log pi_behav + (1-alpha)*log pi_theta with alpha = 1/max(staleness, 1); no forward pass. "
            "`recompute` (decoupled PPO): one no-grad forward of the current policy per generation batch. "
            "`metrics`: recompute and train on it, and also log the error of the loglinear, linear and rollout "
            "approximations against it.",
            "choices": list(PROX_LOGP_METHODS),
        },
    )
    use_decoupled_loss: bool = field(
        default=True,
        metadata={
            "help": "Use the decoupled PPO loss (behaviour weight x clipped ratio to the proximal policy). False "
            "trains with GRPOTrainer's own coupled loss, unchanged: the paper's synchronous baseline."
        },
    )
    behav_imp_weight_cap: float | None = field(
        default=5.0,
        metadata={
            "help": "Tokens whose behaviour importance weight pi_prox/pi_behav exceeds this cap get weight 0 "
            "(they still count in the loss denominator). None disables the cap. Must be > 1."
        },
    )
    dual_clip_c: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip constant c > 1: bounds the loss of negative-advantage tokens at c*|A| before the "
            "behaviour weight. None disables dual clipping."
        },
    )
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's own vLLM importance-sampling correction. None (default) = off with the decoupled loss, "
            "whose behaviour weight already corrects for the behaviour policy (applying both would correct twice), "
            "and TRL's default (on) with `use_decoupled_loss=False`."
        },
    )

    def __post_init__(self):
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = not self.use_decoupled_loss
        super().__post_init__()

        if self.prox_logp_method not in PROX_LOGP_METHODS:
            raise ValueError(
                f"prox_logp_method={self.prox_logp_method!r} is not supported; set it to one of {PROX_LOGP_METHODS}."
            )
        if self.behav_imp_weight_cap is not None and not self.behav_imp_weight_cap > 1.0:
            raise ValueError(
                f"behav_imp_weight_cap={self.behav_imp_weight_cap} would zero on-policy tokens (their weight is 1); "
                "set it to a value > 1 (the paper uses 5.0) or None to disable the cap."
            )
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c={self.dual_clip_c} must be > 1 (typically 3.0), or None to disable it.")
        if not self.use_decoupled_loss:
            return

        unsupported = {
            "loss_type": (
                self.loss_type not in DECOUPLED_LOSS_TYPES,
                f"loss_type={self.loss_type!r} has no per-token clipped surrogate to decouple; use one of "
                f"{DECOUPLED_LOSS_TYPES}, or use_decoupled_loss=False",
            ),
            "importance_sampling_level": (
                self.importance_sampling_level != "token",
                "the decoupled loss is per token; set importance_sampling_level='token'",
            ),
            "vllm_importance_sampling_correction": (
                self.vllm_importance_sampling_correction,
                "the behaviour weight pi_prox/pi_behav replaces TRL's vLLM importance-sampling correction; set "
                "vllm_importance_sampling_correction=False (or leave it unset)",
            ),
            "use_transformers_continuous_batching": (
                self.use_transformers_continuous_batching,
                "continuous batching returns no behaviour log-probs; set use_transformers_continuous_batching=False "
                "or use_vllm=True",
            ),
            "delta": (self.delta is not None, "use dual_clip_c instead of TRL's two-sided `delta` clip"),
            "off_policy_mask_threshold": (
                self.off_policy_mask_threshold is not None,
                "the behaviour weight cap (behav_imp_weight_cap) handles off-policy tokens; unset "
                "off_policy_mask_threshold",
            ),
            "top_entropy_quantile": (
                self.top_entropy_quantile != 1.0,
                "entropy masking is not implemented for the decoupled loss; set top_entropy_quantile=1.0",
            ),
            "entropy_coef": (
                self.entropy_coef != 0.0 or self.use_adaptive_entropy,
                "the entropy bonus is not implemented for the decoupled loss; set entropy_coef=0.0 and "
                "use_adaptive_entropy=False",
            ),
        }
        for name, (bad, fix) in unsupported.items():
            if bad:
                raise ValueError(f"A3POConfig.{name}: {fix}.")
