"""Every TRL loss type, importance-sampling level and loss option under the decoupled loss.

At staleness 0 (behaviour log-probs = the anchor) the decoupled loss must be GRPOTrainer's `_compute_loss` on the
same batch, loss and gradients; at staleness 2 it must be the decoupled formula written out by hand below: the
anchor is the loglinear interpolation (or the recomputed proximal log-probs), the loss type's surrogate of
pi_theta / anchor, times the capped behaviour weight pi_anchor / pi_behav.
"""

import functools
import math

import pytest
import testing_utils
import torch
from testing_utils import generate_two_versions_ahead, handmade_batch, loss_and_grads, producer_threads
from trl import GRPOConfig, GRPOTrainer

from trl_a3po import A3POConfig, A3POTrainer


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
LEVELS = ["token", "sequence"]
# TRL's loss options, each on top of a loss type it is meant for.
OPTIONS = {
    "delta": dict(loss_type="grpo", delta=1.1),
    "entropy_bonus": dict(loss_type="grpo", entropy_coef=0.05),
    "adaptive_entropy": dict(
        loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0, entropy_coef_delta=0.01
    ),
    "entropy_mask": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "off_policy_mask": dict(loss_type="bnpo", off_policy_mask_threshold=0.02),
    "kl_bias_corrected": dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True),
}
CASES = [dict(loss_type=t, importance_sampling_level=lv) for t in LOSS_TYPES for lv in LEVELS] + list(OPTIONS.values())
IDS = [f"{t}-{lv}" for t in LOSS_TYPES for lv in LEVELS] + list(OPTIONS)

# This module's shape over the tests' common config: short completions and a tighter clip (its hand-checked numbers).
make_trainer = functools.partial(testing_utils.make_trainer, max_completion_length=6, epsilon=0.1)


def forward(trainer, batch):
    return trainer._get_per_token_logps_and_entropies(
        trainer.model,
        torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        batch["completion_ids"].size(1),
        compute_entropy=True,
    )


@pytest.mark.parametrize("method", ["loglinear", "recompute"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_at_staleness_0_the_decoupled_loss_is_grpotrainers(tmp_path, tokenizer, prompt_dataset, case, method):
    grpo = make_trainer(tmp_path / "g", tokenizer, prompt_dataset, GRPOTrainer, GRPOConfig, **case)
    a3po = make_trainer(
        tmp_path / "a", tokenizer, prompt_dataset, A3POTrainer, A3POConfig, prox_logp_method=method, **case
    )
    a3po.model.load_state_dict(grpo.model.state_dict())
    batch = handmade_batch(grpo, behav_noise=0.15)
    if method == "recompute":  # the anchor a recompute forward would have given: the behaviour log-probs, at d = 0
        batch["prox_per_token_logps"] = batch["sampling_per_token_logps"]
    for step in (0, 1):  # two optimizer steps: the adaptive entropy coefficient moves after the first
        grpo.state.global_step = a3po.state.global_step = step
        batch["behavior_version"] = torch.full_like(batch["completion_ids"], step)  # staleness 0
        loss_g, grad_g = loss_and_grads(grpo, batch)
        loss_a, grad_a = loss_and_grads(a3po, batch)
        assert torch.allclose(loss_a, loss_g, atol=1e-6), (step, loss_a, loss_g)
        assert torch.allclose(grad_a, grad_g, atol=1e-6), step
        assert a3po.entropy_coef == grpo.entropy_coef
    # the options did something: the loss differs from the plain GRPO loss on the same batch
    if case in OPTIONS.values():
        plain = make_trainer(
            tmp_path / "p", tokenizer, prompt_dataset, GRPOTrainer, GRPOConfig, loss_type=case["loss_type"]
        )
        plain.model.load_state_dict(grpo.model.state_dict())
        assert not torch.allclose(loss_and_grads(plain, batch)[0], loss_g, atol=1e-6)


def reference_loss(trainer, batch, logp, entropies, anchor, cap):
    """The decoupled loss of `trainer.args`, written out from the formulas (one process, no accumulation)."""
    args = trainer.args
    mask = batch["completion_mask"].float()
    behav = batch["sampling_per_token_logps"]
    adv = batch["advantages"][:, None]
    weight = torch.exp(anchor - behav)
    weight = torch.where(weight > cap, torch.zeros_like(weight), weight) * mask  # the paper's cap: masked to 0
    log_ratio = logp - anchor
    if args.importance_sampling_level == "sequence":  # GSPO: geometric mean of the token ratios
        log_ratio_used = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    else:
        log_ratio_used = log_ratio
    r = torch.exp(log_ratio_used)
    eps_low, eps_high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    loss_type = args.loss_type
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        r_capped = r if args.delta is None else torch.clamp(r, max=args.delta)
        surrogate = -torch.min(r_capped * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    elif loss_type == "cispo":
        surrogate = -torch.clamp(r, max=eps_high).detach() * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        surrogate = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
    else:  # vespo: phi(w) = exp(lambda + k log w - lambda w), w = pi_theta / pi_behav over the sequence
        log_w = ((log_ratio + torch.log(weight.clamp(min=1e-8))) * mask).detach().sum(-1, keepdim=True)
        k = torch.where(adv >= 0, args.vespo_k_pos, args.vespo_k_neg)
        lam = torch.where(adv >= 0, args.vespo_lambda_pos, args.vespo_lambda_neg)
        surrogate = -torch.exp(lam + k * log_w - lam * torch.exp(log_w)) * adv * logp
    per_token = surrogate if loss_type == "vespo" else surrogate * weight
    if args.off_policy_mask_threshold is not None:  # drop negative-advantage sequences that drifted too far
        drift = ((behav - logp.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        per_token = per_token * ((adv >= 0) | (drift <= args.off_policy_mask_threshold)).float()
    effective = mask
    if args.top_entropy_quantile < 1.0:  # train only the tokens at or above the entropy quantile
        threshold = torch.quantile(entropies[mask.bool()], 1 - args.top_entropy_quantile)
        effective = mask * (entropies >= threshold).float()
        per_token = per_token * effective
    if args.beta != 0.0:
        ref = batch["ref_per_token_logps"]
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + args.beta * kl * torch.exp(logp - behav)
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum()
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (mask.size(0) * args.max_completion_length)
    elif loss_type == "luspo":
        loss = masked.sum(-1).mean()
    else:  # dapo, cispo, vespo
        loss = masked.sum() / mask.sum()
    if args.entropy_coef != 0.0:
        loss = loss - args.entropy_coef * (entropies * effective).sum() / effective.sum()
    return loss


@pytest.mark.parametrize("method", ["loglinear", "recompute"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.get("use_adaptive_entropy")], ids=[i for i in IDS if i != "adaptive_entropy"]
)
def test_at_staleness_2_the_decoupled_loss_is_the_formula(tmp_path, tokenizer, prompt_dataset, case, method):
    cap = 1.1  # some behaviour weights above it (masked)
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        prox_logp_method=method,
        behav_imp_weight_cap=cap,
        **case,
    )
    batch = handmade_batch(trainer, seed=1)
    g = torch.Generator().manual_seed(2)
    if method == "recompute":  # a proximal forward of weights between the behaviour ones and the current ones
        recomputed = batch["sampling_per_token_logps"] + 0.1 * torch.randn(batch["completion_ids"].shape, generator=g)
        batch["prox_per_token_logps"] = recomputed
    trainer.state.global_step = 2  # version 2 trains tokens of version 0: d = 2, alpha = 1/2
    loss, grads = loss_and_grads(trainer, batch)

    trainer.model.zero_grad()
    logp, entropies, _ = forward(trainer, batch)
    anchor = (
        0.5 * batch["sampling_per_token_logps"] + 0.5 * logp.detach()
        if method == "loglinear"
        else batch["prox_per_token_logps"]
    )
    weights = torch.exp(anchor - batch["sampling_per_token_logps"])[batch["completion_mask"].bool()]
    assert (weights > cap).any() and (weights <= cap).any(), "the cap should bite on some tokens, not all"
    expected = reference_loss(trainer, batch, logp, entropies, anchor, cap)
    expected.backward()
    expected_grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(grads, expected_grads, atol=1e-6)
    assert not math.isclose(loss.item(), 0.0, abs_tol=1e-9)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_option_trains_asynchronously_within_the_bound(tmp_path, tokenizer, prompt_dataset, case):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        max_steps=8,
        logging_steps=1,
        learning_rate=1e-3,
        **case,
    )
    assert trainer.args.async_generation and trainer.args.max_staleness == 2  # A3POConfig's defaults
    generate_two_versions_ahead(trainer)
    trainer.train()
    staleness = [h["a3po/staleness/max"] for h in trainer.state.log_history if "a3po/staleness/max" in h]
    assert staleness == [0, 1] + [2] * 6
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert producer_threads() == []
