"""The A-3PO math: staleness -> alpha, proximal log-prob approximations, the decoupled PPO loss.

Torch only, on purpose: anyone can check this file against the paper (arXiv 2512.06547) without reading TRL.
Every tensor of log-probs here is per token, shaped (B, T); staleness is per token, shaped (B, T) (a sequence whose
generation spanned a weight update has tokens of several versions), or per sample, shaped (B,).

Notation (the paper's):
  behav  log pi_behav   the policy that generated the tokens (version v_b)
  prox   log pi_prox    the proximal policy the trust region is centred on
  logp   log pi_theta   the policy being optimised (version V); staleness d = V - v_b
  w = pi_prox / pi_behav   behaviour importance weight (no gradient)
  r = pi_theta / pi_prox   trust-region ratio, clipped to [1 - eps_low, 1 + eps_high]
  loss_t = -w * min(r * A, clip(r) * A)
"""

from __future__ import annotations

import torch

PROX_APPROXIMATIONS = ("loglinear", "linear", "rollout")
BEHAV_WEIGHT_MODES = ("mask", "truncate")
BEHAV_WEIGHT_LEVELS = ("token", "sequence")
AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


def staleness_alpha(staleness: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """alpha = 1 / max(d, 1): the weight of the behaviour policy in the proximal interpolation.

    Staleness d is counted in policy versions (training steps). d <= 1 gives alpha = 1, i.e. prox = behav: one
    version behind, the behaviour policy *is* the last proximal policy (AReaL's reference code behaves the same
    way); in synchronous training (d = 0) the proximal policy is exactly the behaviour policy.
    """
    if torch.is_floating_point(staleness):
        raise TypeError("staleness counts policy versions and must be an integer tensor")
    if (staleness < 0).any():
        raise ValueError(f"staleness must be >= 0 (the behaviour policy cannot be newer than the trainer); got "
                         f"min {int(staleness.min())}")
    return 1.0 / staleness.clamp(min=1).to(dtype)


def approximate_prox_logp(
    method: str, behav_logp: torch.Tensor, logp: torch.Tensor, staleness: torch.Tensor
) -> torch.Tensor:
    """Proximal log-probs without a forward pass. The result carries no gradient.

    - ``loglinear`` (A-3PO): alpha * behav + (1 - alpha) * logp, a geometric mixture of the two policies;
    - ``linear``: log(alpha * p_behav + (1 - alpha) * p_theta), the arithmetic (probability-space) mixture;
    - ``rollout``: prox = behav (no trust region around anything but the behaviour policy).
    ``staleness`` is (B, T), each token's alpha from its own staleness, or (B,), one staleness for all of a row's
    tokens.
    """
    logp = logp.detach()
    alpha = staleness_alpha(staleness, logp.dtype).to(logp.device)
    if alpha.dim() == 1:  # per sample: (B, 1) broadcasts over its tokens
        alpha = alpha.unsqueeze(-1)
    if method == "loglinear":
        return alpha * behav_logp + (1.0 - alpha) * logp
    if method == "linear":
        # logaddexp keeps it finite when either probability underflows
        return torch.logaddexp(torch.log(alpha) + behav_logp, torch.log1p(-alpha) + logp)
    if method == "rollout":
        return behav_logp.clone()
    raise ValueError(f"unknown proximal approximation {method!r}; expected one of {PROX_APPROXIMATIONS}")


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    behav_imp_weight_cap: float | None = None,
    dual_clip_c: float | None = None,
    behav_imp_weight_mode: str = "mask",
    behav_imp_weight_min: float | None = None,
    behav_imp_weight_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled PPO loss and its statistics.

    Returns ``(per_token_loss, stats)``: the loss is (B, T) and not yet aggregated (aggregation is the caller's
    choice of ``loss_type``, see :func:`aggregate_loss`); padding positions are zero. ``advantages`` is (B,) or
    (B, T). ``dual_clip_c`` bounds the loss of negative-advantage tokens at ``c * |A|`` (before the behaviour
    weight), as in dual-clip PPO.

    The behaviour weight ``w = pi_prox / pi_behav`` outside ``[behav_imp_weight_min, behav_imp_weight_cap]`` (either
    bound None = unbounded on that side):
    - ``mode="mask"`` (the paper's cap; with a lower bound, a two-sided mask as in IcePop): the weight becomes 0;
    - ``mode="truncate"`` (truncated importance sampling): the weight is clamped into the bounds.
    ``level="token"`` bounds each token's weight; ``level="sequence"`` gives every token of a sequence the
    sequence's weight, the geometric mean of its token weights ``exp(mean_t(log w_t))``, and bounds that (masking or
    truncating whole sequences). Masked tokens stay in the mask, so they still count in the denominator of the
    aggregation. The weight carries no gradient in any mode.

    ``stats`` holds 0-dim tensors of masked sums and extremes (``*_sum``, ``*_min``, ``*_max``, ``num_tokens``,
    ``num_seqs``), so callers can reduce them across micro-batches and processes exactly.
    """
    if behav_imp_weight_mode not in BEHAV_WEIGHT_MODES:
        raise ValueError(f"behav_imp_weight_mode={behav_imp_weight_mode!r}; expected one of {BEHAV_WEIGHT_MODES}")
    if behav_imp_weight_level not in BEHAV_WEIGHT_LEVELS:
        raise ValueError(f"behav_imp_weight_level={behav_imp_weight_level!r}; expected one of {BEHAV_WEIGHT_LEVELS}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = mask.bool()
    prox_logp = prox_logp.detach()
    behav_logp = behav_logp.detach()

    if behav_imp_weight_level == "token":
        behav_imp_weight = torch.exp(prox_logp - behav_logp)
    else:  # the geometric mean of the sequence's token weights, for each of its tokens
        log_weight = torch.where(mask, prox_logp - behav_logp, torch.zeros_like(prox_logp))
        sequence_weight = torch.exp(log_weight.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
        behav_imp_weight = sequence_weight.expand_as(prox_logp)
    above = (behav_imp_weight > behav_imp_weight_cap) & mask if behav_imp_weight_cap is not None else None
    below = (behav_imp_weight < behav_imp_weight_min) & mask if behav_imp_weight_min is not None else None
    capped = above if above is not None else torch.zeros_like(mask)  # above the cap (masked or truncated)
    below_min = below if below is not None else torch.zeros_like(mask)
    if behav_imp_weight_mode == "mask":
        dropped = capped | below_min
        behav_imp_weight = torch.where(dropped, torch.zeros_like(behav_imp_weight), behav_imp_weight)
    else:
        dropped = torch.zeros_like(mask)
        if behav_imp_weight_min is not None or behav_imp_weight_cap is not None:
            behav_imp_weight = behav_imp_weight.clamp(min=behav_imp_weight_min, max=behav_imp_weight_cap)
    behav_imp_weight = torch.where(mask, behav_imp_weight, torch.zeros_like(behav_imp_weight))

    ratio = torch.exp(logp - prox_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    pg_loss = torch.max(-ratio * advantages, -clipped_ratio * advantages)
    if dual_clip_c is not None:
        bounded = torch.min(pg_loss, dual_clip_c * advantages.abs())
        dual_clipped = (advantages < 0) & (pg_loss > bounded) & mask
        pg_loss = torch.where(advantages < 0, bounded, pg_loss)
    else:
        dual_clipped = torch.zeros_like(mask)
    per_token_loss = pg_loss * behav_imp_weight

    with torch.no_grad():
        ratio_d = ratio.detach()
        low_clipped = (ratio_d < 1.0 - epsilon_low) & (advantages < 0) & mask
        high_clipped = (ratio_d > 1.0 + epsilon_high) & (advantages > 0) & mask
        weight_in_mask = behav_imp_weight.masked_select(mask & ~dropped)
        ratio_in_mask = ratio_d.masked_select(mask)
        num_tokens = mask.sum()

        def _extreme(values: torch.Tensor, fn) -> torch.Tensor:
            return fn(values) if values.numel() else torch.tensor(float("nan"), device=mask.device)

        stats = {
            "num_tokens": num_tokens.to(torch.float32),
            "behav_imp_weight_sum": weight_in_mask.sum(),
            "behav_imp_weight_count": torch.tensor(float(weight_in_mask.numel()), device=mask.device),
            "behav_imp_weight_min": _extreme(weight_in_mask, torch.min),
            "behav_imp_weight_max": _extreme(weight_in_mask, torch.max),
            "capped_sum": capped.sum().to(torch.float32),
            "below_min_sum": below_min.sum().to(torch.float32),
            "num_seqs": mask.any(-1).sum().to(torch.float32),
            "seq_capped_sum": capped.any(-1).sum().to(torch.float32),
            "seq_below_min_sum": below_min.any(-1).sum().to(torch.float32),
            "clip_low_sum": low_clipped.sum().to(torch.float32),
            "clip_high_sum": high_clipped.sum().to(torch.float32),
            "dual_clip_sum": dual_clipped.sum().to(torch.float32),
            "ratio_min": _extreme(ratio_in_mask, torch.min),
            "ratio_max": _extreme(ratio_in_mask, torch.max),
        }
    return per_token_loss, stats


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with TRL's semantics for ``loss_type``.

    - ``grpo``: mean over each sequence's tokens, then over sequences;
    - ``bnpo``: mean over all tokens of the micro-batch;
    - ``dr_grpo``: sum over tokens / (num_sequences * max_completion_length);
    - ``dapo``: sum over tokens / ``num_items`` (the token count of the whole accumulation window, so every token
      of the optimizer step weighs the same).
    Scaling for gradient accumulation (for all but ``dapo``) is the caller's.
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        if num_items is None:
            raise ValueError("loss_type 'dapo' needs num_items (tokens in the accumulation window)")
        return masked.sum() / num_items
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {AGGREGATIONS}")
