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
  loss_t = -w * min(r * A, clip(r) * A)   (PPO's surrogate; every TRL loss type's own surrogate of r composes the same
                                          way, see decoupled_ppo_loss)
"""

from __future__ import annotations

from collections.abc import Callable

import torch


PROX_APPROXIMATIONS = ("loglinear", "linear", "rollout")
BEHAV_WEIGHT_MODES = ("mask", "truncate")
BEHAV_WEIGHT_LEVELS = ("token", "sequence")
# TRL 1.16's loss types: the clipped surrogate min(r*A, clip(r)*A) with one of five aggregations, and three others.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = CLIPPED_LOSS_TYPES + ("cispo", "sapo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
NUM_ITEMS_LOSS_TYPES = ("dapo", "cispo", "vespo")  # normalised by the accumulation window's token count


def staleness_alpha(staleness: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """alpha = 1 / max(d, 1): the weight of the behaviour policy in the proximal interpolation.

    Staleness d is counted in policy versions (training steps). d <= 1 gives alpha = 1, i.e. prox = behav: one
    version behind, the behaviour policy *is* the last proximal policy (AReaL's reference code behaves the same
    way); in synchronous training (d = 0) the proximal policy is exactly the behaviour policy.
    """
    if torch.is_floating_point(staleness):
        raise TypeError("staleness counts policy versions and must be an integer tensor")
    if (staleness < 0).any():
        raise ValueError(
            f"staleness must be >= 0 (the behaviour policy cannot be newer than the trainer); got "
            f"min {int(staleness.min())}"
        )
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


def behaviour_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None = None,
    mode: str = "mask",
    low: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The behaviour weight ``w = pi_prox / pi_behav`` with its bounds, (B, T), 0 at padding, no gradient.

    Returns ``(weight, above_cap, below_min, dropped)``; the last three are (B, T) token masks (see
    :func:`decoupled_ppo_loss` for the modes and levels).
    """
    if mode not in BEHAV_WEIGHT_MODES:
        raise ValueError(f"behav_imp_weight_mode={mode!r}; expected one of {BEHAV_WEIGHT_MODES}")
    if level not in BEHAV_WEIGHT_LEVELS:
        raise ValueError(f"behav_imp_weight_level={level!r}; expected one of {BEHAV_WEIGHT_LEVELS}")
    prox_logp, behav_logp = prox_logp.detach(), behav_logp.detach()
    if level == "token":
        weight = torch.exp(prox_logp - behav_logp)
    else:  # the geometric mean of the sequence's token weights, for each of its tokens
        log_weight = torch.where(mask, prox_logp - behav_logp, torch.zeros_like(prox_logp))
        weight = torch.exp(log_weight.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
        weight = weight.expand_as(prox_logp)
    above = (weight > cap) & mask if cap is not None else torch.zeros_like(mask)
    below = (weight < low) & mask if low is not None else torch.zeros_like(mask)
    if mode == "mask":
        dropped = above | below
        weight = torch.where(dropped, torch.zeros_like(weight), weight)
    else:
        dropped = torch.zeros_like(mask)
        if low is not None or cap is not None:
            weight = weight.clamp(min=low, max=cap)
    return torch.where(mask, weight, torch.zeros_like(weight)), above, below, dropped


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
    *,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    gamma_weights: Callable[..., torch.Tensor] | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled loss of any PPO-family surrogate, and its statistics.

    Decoupled PPO takes a surrogate whose anchor ("old" policy) is the proximal policy and multiplies it by the
    behaviour weight. The surrogate is ``loss_type``'s, as TRL defines it, of the ratio ``r = pi_theta / pi_prox``
    (per token, or with ``importance_sampling_level="sequence"`` the geometric mean of a sequence's token ratios,
    GSPO's sequence ratio):
    - ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``: ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)``, with r capped
      at ``delta`` first when given (TRL's two-sided clip), and ``dual_clip_c`` bounding the loss of negative-advantage
      tokens at ``c*|A|``;
    - ``cispo``: ``-sg(min(r, epsilon_high)) * A * log pi_theta`` (the clipped ratio as a stop-gradient weight);
    - ``sapo``: ``-sigmoid(tau*(r-1)) * 4/tau * A``, tau = ``sapo_temperatures`` (A > 0, A <= 0);
    - ``vespo``: ``-phi(w_seq) * A * log pi_theta``, ``phi = gamma_weights(advantages=, log_ratio_per_token=, mask=,
      importance_sampling_ratio=)`` (TRL's ``GRPOTrainer.get_gamma_weights`` with its k, lambda): there the behaviour
      weight enters as the importance-sampling ratio inside phi (as TRL's sampler correction does), not as a factor.
    Then ``w = pi_prox / pi_behav`` (:func:`behaviour_weight`) multiplies every other type, and ``keep`` (TRL's
    off-policy and entropy masks, (B, 1) or (B, T), computed by the caller) multiplies the result.

    Returns ``(per_token_loss, stats)``: the loss is (B, T) and not yet aggregated (see :func:`aggregate_loss`);
    padding positions are zero. ``advantages`` is (B,) or (B, T).

    The behaviour weight outside ``[behav_imp_weight_min, behav_imp_weight_cap]`` (either bound None = unbounded on
    that side):
    - ``mode="mask"`` (the paper's cap; with a lower bound, a two-sided mask as in IcePop): the weight becomes 0;
    - ``mode="truncate"`` (truncated importance sampling): the weight is clamped into the bounds.
    ``level="token"`` bounds each token's weight; ``level="sequence"`` gives every token of a sequence the
    sequence's weight, the geometric mean of its token weights ``exp(mean_t(log w_t))``, and bounds that (masking or
    truncating whole sequences). Masked tokens stay in the mask, so they still count in the denominator of the
    aggregation. The weight carries no gradient in any mode.

    ``stats`` holds 0-dim tensors of masked sums and extremes (``*_sum``, ``*_min``, ``*_max``, ``num_tokens``,
    ``num_seqs``, ``ratio_units``: the tokens, or at sequence level the rows, the clip counts are over), so callers
    can reduce them across micro-batches and processes exactly.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r}; expected one of {IMPORTANCE_SAMPLING_LEVELS}"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = mask.bool()
    prox_logp = prox_logp.detach()
    weight, capped, below_min, dropped = behaviour_weight(
        prox_logp,
        behav_logp,
        mask,
        behav_imp_weight_cap,
        behav_imp_weight_mode,
        behav_imp_weight_min,
        behav_imp_weight_level,
    )

    log_ratio = logp - prox_logp
    if importance_sampling_level == "sequence":  # (B, 1): the geometric mean of the sequence's token ratios
        log_ratio_used = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used)

    zeros = torch.zeros_like(mask)
    dual_clipped = zeros
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        capped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
        pg_loss = -torch.min(capped_ratio * advantages, clipped_ratio * advantages)
        if dual_clip_c is not None:
            bounded = torch.min(pg_loss, dual_clip_c * advantages.abs())
            dual_clipped = ((advantages < 0) & (pg_loss > bounded)).expand_as(mask) & mask
            pg_loss = torch.where(advantages < 0, bounded, pg_loss)
    elif loss_type == "cispo":
        pg_loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logp
    elif loss_type == "sapo":
        tau = torch.where(advantages > 0, sapo_temperatures[0], sapo_temperatures[1])
        pg_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    else:  # vespo
        if gamma_weights is None:
            raise ValueError("loss_type 'vespo' needs gamma_weights (e.g. TRL's GRPOTrainer.get_gamma_weights)")
        # Padding must read as ratio 1 (phi sums log-ratios over every position, as TRL's sampler ratio is 1 there).
        sampler_ratio = torch.where(mask, weight, torch.ones_like(weight))
        phi = gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask.to(logp.dtype),
            importance_sampling_ratio=sampler_ratio,
        )
        pg_loss = -phi * advantages * logp
    per_token_loss = pg_loss if loss_type == "vespo" else pg_loss * weight
    if keep is not None:
        per_token_loss = per_token_loss * keep
    per_token_loss = torch.where(mask, per_token_loss.expand_as(logp), torch.zeros_like(logp))

    with torch.no_grad():
        ratio_d = ratio.detach()
        units = mask if importance_sampling_level == "token" else torch.ones_like(ratio_d, dtype=torch.bool)
        if loss_type in CLIPPED_LOSS_TYPES:
            low_clipped = (ratio_d < 1.0 - epsilon_low) & (advantages < 0) & units
            high_clipped = (ratio_d > 1.0 + epsilon_high) & (advantages > 0) & units
        elif loss_type == "cispo":  # TRL's cispo_clip_ratio: the weight capped at epsilon_high
            low_clipped, high_clipped = zeros, (ratio_d > epsilon_high) & (advantages > 0) & units
        else:
            low_clipped = high_clipped = zeros
        weight_in_mask = weight.masked_select(mask & ~dropped)
        ratio_in_mask = ratio_d.expand_as(mask).masked_select(mask)
        num_tokens = mask.sum()

        def _extreme(values: torch.Tensor, fn) -> torch.Tensor:
            return fn(values) if values.numel() else torch.tensor(float("nan"), device=mask.device)

        stats = {
            "num_tokens": num_tokens.to(torch.float32),
            "num_rows": torch.tensor(float(mask.size(0)), device=mask.device),
            "ratio_units": units.sum().to(torch.float32),
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
        if loss_type == "vespo":  # TRL's vespo/phi_seq_mean: over sequences
            stats["vespo_phi_sum"] = phi.detach().sum()
    return per_token_loss, stats


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with TRL's semantics for ``loss_type``.

    - ``grpo``, ``sapo``: mean over each sequence's tokens, then over sequences;
    - ``bnpo``: mean over all tokens of the micro-batch;
    - ``dr_grpo``: sum over tokens / (num_sequences * max_completion_length);
    - ``luspo``: sum over each sequence's tokens, then mean over sequences;
    - ``dapo``, ``cispo``, ``vespo``: sum over tokens / ``num_items`` (the token count of the whole accumulation
      window, so every token of the optimizer step weighs the same).
    Scaling for gradient accumulation (for all but the ``num_items`` types) is the caller's.
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "luspo":
        return masked.sum(-1).mean()
    if loss_type in NUM_ITEMS_LOSS_TYPES:
        if num_items is None:
            raise ValueError(f"loss_type {loss_type!r} needs num_items (tokens in the accumulation window)")
        return masked.sum() / num_items
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
