"""The A-3PO math against exact values, properties and a hand-written reference."""

import math

import pytest
import torch

from trl_a3po.proximal import aggregate_loss, approximate_prox_logp, decoupled_ppo_loss, staleness_alpha


def test_alpha_exact_values():
    d = torch.tensor([0, 1, 2, 3, 4, 10])
    assert staleness_alpha(d).tolist() == [1.0, 1.0, 0.5, pytest.approx(1 / 3), 0.25, pytest.approx(0.1)]


def test_alpha_rejects_negative_and_float_staleness():
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_alpha(torch.tensor([1, -1]))
    with pytest.raises(TypeError, match="integer"):
        staleness_alpha(torch.tensor([1.0]))


def test_loglinear_exact_value():
    prox = approximate_prox_logp("loglinear", torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([2]))
    assert prox.item() == pytest.approx(-1.25, abs=1e-7)


def test_linear_exact_value():
    behav, theta = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    prox = approximate_prox_logp("linear", behav, theta, torch.tensor([2]))
    assert prox.item() == pytest.approx(math.log(0.375), abs=1e-6)


def test_rollout_is_behaviour_and_unknown_method_raises():
    behav = torch.randn(2, 3)
    assert torch.equal(approximate_prox_logp("rollout", behav, torch.randn(2, 3), torch.tensor([5, 7])), behav)
    with pytest.raises(ValueError, match="unknown proximal approximation 'nope'"):
        approximate_prox_logp("nope", behav, behav, torch.tensor([1, 1]))


def _random_logps(generator, shape=(6, 9)):
    behav = -torch.rand(shape, generator=generator, dtype=torch.float64) * 4
    theta = behav + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5
    staleness = torch.randint(0, 9, (shape[0],), generator=generator)
    return behav, theta.clamp(max=0), staleness


@pytest.mark.parametrize("seed", range(20))
def test_approximation_properties(seed):
    g = torch.Generator().manual_seed(seed)
    behav, theta, staleness = _random_logps(g)
    alpha = staleness_alpha(staleness, torch.float64).unsqueeze(-1)
    for method in ("loglinear", "linear"):
        prox = approximate_prox_logp(method, behav, theta, staleness)
        lo, hi = torch.minimum(behav, theta), torch.maximum(behav, theta)
        assert ((prox >= lo - 1e-12) & (prox <= hi + 1e-12)).all(), f"{method}: prox outside [behav, theta]"
        stale_rows = staleness <= 1
        assert torch.allclose(prox[stale_rows], behav[stale_rows], atol=1e-12), "d <= 1 must give prox = behav"
    prox = approximate_prox_logp("loglinear", behav, theta, staleness)
    r = torch.exp(theta - prox)
    w = torch.exp(prox - behav)
    assert torch.allclose(r, torch.exp(theta - behav) ** alpha, rtol=1e-10)  # r = (p_theta / p_behav)^alpha
    assert torch.allclose(r * w, torch.exp(theta - behav), rtol=1e-10)  # r * w = p_theta / p_behav


def test_per_token_staleness_gives_each_token_its_own_alpha():
    # A sequence generated across a weight update: its first tokens by version 3, the rest by version 5; trained by
    # version 6, their staleness is 3 then 1 (alpha 1/3, then 1: prox = behav).
    behav = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    theta = torch.tensor([[-1.6, -0.8, -0.2, -2.4]], dtype=torch.float64)
    staleness = torch.tensor([[3, 3, 1, 1]])
    prox = approximate_prox_logp("loglinear", behav, theta, staleness)
    expected = [(-1.0 - 2 * 1.6) / 3, (-2.0 - 2 * 0.8) / 3, -0.5, -3.0]
    assert prox[0].tolist() == pytest.approx(expected, abs=1e-12)
    linear = approximate_prox_logp("linear", behav, theta, staleness)
    assert linear[0, 0].item() == pytest.approx(math.log(math.exp(-1.0) / 3 + 2 * math.exp(-1.6) / 3), abs=1e-12)
    assert linear[0, 2:].tolist() == pytest.approx([-0.5, -3.0], abs=1e-12)
    # One staleness per row, given per sample or repeated over its tokens: the same proximal log-probs.
    g = torch.Generator().manual_seed(0)
    behav, theta, per_sample = _random_logps(g)
    per_token = per_sample.unsqueeze(-1).expand_as(behav)
    for method in ("loglinear", "linear", "rollout"):
        assert torch.equal(
            approximate_prox_logp(method, behav, theta, per_sample),
            approximate_prox_logp(method, behav, theta, per_token),
        )


def test_loglinear_prox_has_no_gradient_and_ratio_gradient_is_full():
    behav = torch.tensor([[-1.0, -2.0]])
    theta = torch.tensor([[-1.5, -0.5]], requires_grad=True)
    prox = approximate_prox_logp("loglinear", behav, theta, torch.tensor([4]))
    assert not prox.requires_grad
    torch.exp(theta - prox).sum().backward()
    # d/dtheta exp(theta - prox) = r, with prox held fixed
    assert torch.allclose(theta.grad, torch.exp(theta - prox).detach())


def reference_loss(logp, prox, behav, adv, mask, eps_lo, eps_hi, cap, c):
    """Token-by-token Python loops, written from the paper's formula."""
    B, T = logp.shape
    out = torch.zeros(B, T, dtype=logp.dtype)
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            w = math.exp(prox[i, t].item() - behav[i, t].item())
            if cap is not None and w > cap:
                w = 0.0
            r = torch.exp(logp[i, t] - prox[i, t].item())
            a = adv[i].item()
            clipped = torch.clamp(r, 1 - eps_lo, 1 + eps_hi)
            term = -torch.min(r * a, clipped * a)
            if c is not None and a < 0:
                term = torch.min(term, torch.tensor(c * abs(a), dtype=logp.dtype))
            out[i, t] = w * term
    return out


@pytest.mark.parametrize("cap,c", [(None, None), (2.0, None), (1.5, 3.0), (None, 1.2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_reference(seed, cap, c):
    g = torch.Generator().manual_seed(seed)
    behav, theta, staleness = _random_logps(g, (5, 7))
    adv = torch.randn(5, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(5, 7, generator=g) > 0.25
    prox = approximate_prox_logp("loglinear", behav, theta, staleness)
    # push some tokens far so the cap and the clip both bite
    behav = behav.clone()
    behav[0, :3] -= 2.0

    logp_a = theta.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(logp_a, prox, behav, adv, mask, 0.2, 0.28, cap, c)
    logp_b = theta.clone().requires_grad_(True)
    ref = reference_loss(logp_b, prox, behav, adv, mask, 0.2, 0.28, cap, c)
    assert torch.allclose(loss, ref, atol=1e-12)
    weights = torch.rand(5, 7, generator=g, dtype=torch.float64)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    assert torch.allclose(logp_a.grad, logp_b.grad, atol=1e-12)
    assert (loss[~mask] == 0).all()
    assert stats["num_tokens"].item() == mask.sum().item()


def test_cap_mask_clip_masks_and_stats_exact():
    # 1 sequence, 4 tokens; A = +1 on all
    behav = torch.log(torch.tensor([[0.5, 0.1, 0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.5, 0.6, 0.5, 0.5]]))  # w = 1, 6 (capped at 5), 1, 1
    logp = torch.log(torch.tensor([[0.5, 0.6, 0.9, 0.2]]))  # r = 1, 1, 1.8 (high clip), 0.4
    adv = torch.tensor([1.0])
    mask = torch.tensor([[1, 1, 1, 1]])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 0.2, behav_imp_weight_cap=5.0)
    expected = torch.tensor([[-1.0, 0.0, -1.2, -0.4]])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert stats["capped_sum"].item() == 1
    assert stats["clip_high_sum"].item() == 1  # r = 1.8 > 1.2 with A > 0
    assert stats["clip_low_sum"].item() == 0  # r = 0.4 < 0.8, but A > 0: not clipped by the min
    assert stats["behav_imp_weight_count"].item() == 3  # the capped token is excluded from weight stats
    assert stats["behav_imp_weight_max"].item() == pytest.approx(1.0)
    assert stats["ratio_min"].item() == pytest.approx(0.4, rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(1.8, rel=1e-6)
    # the capped token stays in the denominator: mean over 4 tokens, not 3
    assert aggregate_loss(loss, mask, "bnpo").item() == pytest.approx(-2.6 / 4, rel=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    behav = prox = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[5.0, 1.0]]))  # r = 5 and 1
    loss, stats = decoupled_ppo_loss(logp, prox, behav, torch.tensor([-2.0]), torch.ones(1, 2), 0.2, 0.2, None, 3.0)
    # token 0: -min(5 * -2, 1.2 * -2) = 10, bounded at 3 * 2 = 6; token 1: -min(-2, -2) = 2
    assert loss.tolist() == [[pytest.approx(6.0), pytest.approx(2.0)]]
    assert stats["dual_clip_sum"].item() == 1


def test_aggregations_match_trl_formulas():
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    m = mask.float()
    assert torch.isclose(aggregate_loss(per_token, mask, "grpo"), ((per_token * m).sum(-1) / m.sum(-1)).mean())
    assert torch.isclose(aggregate_loss(per_token, mask, "bnpo"), (per_token * m).sum() / m.sum())
    assert torch.isclose(aggregate_loss(per_token, mask, "dr_grpo", 8), (per_token * m).sum() / (3 * 8))
    for num_items_type in ("dapo", "cispo", "vespo"):
        assert torch.isclose(
            aggregate_loss(per_token, mask, num_items_type, num_items=20.0), (per_token * m).sum() / 20
        )
    assert torch.isclose(aggregate_loss(per_token, mask, "sapo"), ((per_token * m).sum(-1) / m.sum(-1)).mean())
    assert torch.isclose(aggregate_loss(per_token, mask, "luspo"), (per_token * m).sum(-1).mean())
    with pytest.raises(ValueError, match="loss_type 'cispo' needs num_items"):
        aggregate_loss(per_token, mask, "cispo")
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        aggregate_loss(per_token, mask, "ppo")


# ---------------------------------------------------------------- behaviour-weight modes and levels


def frozen_mask_token_loss(logp, prox_logp, behav_logp, advantages, mask, epsilon_low, epsilon_high, cap, c):
    """The decoupled loss as it was before the weight modes existed (mask at the cap, per token): the default must
    stay bit for bit equal to it."""
    advantages = advantages.unsqueeze(-1)
    mask = mask.bool()
    w = torch.exp(prox_logp - behav_logp)
    if cap is not None:
        w = torch.where((w > cap) & mask, torch.zeros_like(w), w)
    w = torch.where(mask, w, torch.zeros_like(w))
    ratio = torch.exp(logp - prox_logp)
    pg = torch.max(-ratio * advantages, -torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantages)
    if c is not None:
        pg = torch.where(advantages < 0, torch.min(pg, c * advantages.abs()), pg)
    return pg * w


@pytest.mark.parametrize("seed", range(10))
def test_default_mode_is_the_old_loss_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    behav, theta, staleness = _random_logps(g, (6, 8))
    behav = behav.float()
    theta = theta.float()
    behav[0, :4] -= 2.0  # some weights above the cap
    prox = approximate_prox_logp("loglinear", behav, theta, staleness)
    adv = torch.randn(6, generator=g)
    mask = torch.rand(6, 8, generator=g) > 0.2
    for cap, c in ((5.0, None), (2.0, 3.0), (None, None)):
        new, _ = decoupled_ppo_loss(theta, prox, behav, adv, mask, 0.2, 0.28, cap, c)
        explicit, _ = decoupled_ppo_loss(
            theta,
            prox,
            behav,
            adv,
            mask,
            0.2,
            0.28,
            cap,
            c,
            behav_imp_weight_mode="mask",
            behav_imp_weight_min=None,
            behav_imp_weight_level="token",
        )
        old = frozen_mask_token_loss(theta, prox, behav, adv, mask, 0.2, 0.28, cap, c)
        assert torch.equal(new, old) and torch.equal(explicit, old)


def _weights_case():
    """One sequence of 4 tokens and one of 2 (+ padding), A = +1, r = 1 everywhere (logp = prox): each token's loss
    is -w, so the loss shows the behaviour weight directly."""
    w = torch.tensor([[0.25, 1.0, 2.0, 8.0], [1.0, 0.5, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    behav = torch.log(torch.full((2, 4), 0.1))
    prox = behav + torch.log(w)
    return prox.clone(), prox, behav, torch.tensor([1.0, 1.0]), mask


@pytest.mark.parametrize(
    "mode,level,low,expected_weights,capped,below,seq_capped,seq_below",
    [
        # cap 4, min 0.4. Token level: w = (0.25, 1, 2, 8 | 1, 0.5)
        ("mask", "token", None, [[0.25, 1, 2, 0], [1, 0.5, 0, 0]], 1, 0, 1, 0),
        ("mask", "token", 0.4, [[0, 1, 2, 0], [1, 0.5, 0, 0]], 1, 1, 1, 1),
        ("truncate", "token", None, [[0.25, 1, 2, 4], [1, 0.5, 0, 0]], 1, 0, 1, 0),
        ("truncate", "token", 0.4, [[0.4, 1, 2, 4], [1, 0.5, 0, 0]], 1, 1, 1, 1),
        # sequence level: geometric means (0.25 * 1 * 2 * 8)^(1/4) = 4^(1/4) = sqrt(2), (1 * 0.5)^(1/2) = sqrt(0.5)
        ("mask", "sequence", None, [[2**0.5] * 4, [0.5**0.5] * 2 + [0, 0]], 0, 0, 0, 0),
        ("mask", "sequence", 0.75, [[2**0.5] * 4, [0, 0, 0, 0]], 0, 2, 0, 1),
        ("truncate", "sequence", 0.75, [[2**0.5] * 4, [0.75, 0.75, 0, 0]], 0, 2, 0, 1),
    ],
)
def test_behaviour_weight_modes_exact(mode, level, low, expected_weights, capped, below, seq_capped, seq_below):
    logp, prox, behav, adv, mask = _weights_case()
    logp = logp.requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        logp,
        prox,
        behav,
        adv,
        mask,
        0.2,
        0.2,
        behav_imp_weight_cap=4.0,
        behav_imp_weight_mode=mode,
        behav_imp_weight_min=low,
        behav_imp_weight_level=level,
    )
    expected = torch.tensor(expected_weights)
    assert torch.allclose(loss, -expected, atol=1e-6)
    loss.sum().backward()
    # r = 1 sits inside the clip range: d(-w * r * A)/d logp = -w * r * A = -w, per token; masked tokens get none
    assert torch.allclose(logp.grad, -expected, atol=1e-6)
    assert stats["capped_sum"].item() == capped and stats["below_min_sum"].item() == below
    assert stats["seq_capped_sum"].item() == seq_capped and stats["seq_below_min_sum"].item() == seq_below
    assert stats["num_tokens"].item() == 6 and stats["num_seqs"].item() == 2


def test_sequence_cap_masks_the_whole_sequence():
    logp, prox, behav, adv, mask = _weights_case()
    loss, stats = decoupled_ppo_loss(
        logp, prox, behav, adv, mask, 0.2, 0.2, behav_imp_weight_cap=1.2, behav_imp_weight_level="sequence"
    )
    # sqrt(2) > 1.2: every token of sequence 0 is dropped, and stays in the denominator
    assert loss[0].tolist() == [0.0] * 4 and stats["seq_capped_sum"].item() == 1 and stats["capped_sum"].item() == 4
    assert aggregate_loss(loss, mask, "bnpo").item() == pytest.approx(-2 * 0.5**0.5 / 6, rel=1e-6)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weight_mode_properties(seed, level):
    g = torch.Generator().manual_seed(seed)
    behav, theta, staleness = _random_logps(g, (6, 8))
    behav = behav.clone()
    behav[:2] -= 1.5  # weights far above the cap
    prox = approximate_prox_logp("loglinear", behav, theta, staleness)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 8, generator=g) > 0.2
    raw = torch.exp(prox - behav)
    for mode in ("mask", "truncate"):
        logp = theta.clone().requires_grad_(True)
        loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 0.28, 2.0, None, mode, 0.5, level)
        ratio = torch.exp(theta - prox)
        pg = torch.max(-ratio * adv[:, None], -ratio.clamp(0.8, 1.28) * adv[:, None])
        weight = torch.where(mask & (pg != 0), loss / pg, torch.zeros_like(loss))  # the weight the loss applied
        assert (weight <= 2.0 + 1e-9).all(), "a weight above the cap"
        if mode == "truncate":
            assert (weight[mask & (pg != 0)] >= 0.5 - 1e-9).all(), "a truncated weight below the lower bound"
        loss.sum().backward()
        if level == "token":
            dropped = mask & ((raw > 2.0) | (raw < 0.5))
            if mode == "mask":
                assert (logp.grad[dropped] == 0).all()  # masked tokens contribute no gradient
                assert stats["capped_sum"].item() + stats["below_min_sum"].item() == dropped.sum().item()
        assert (logp.grad[~mask] == 0).all()


def test_unknown_mode_and_level_are_named():
    args = torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), 0.2, 0.2
    with pytest.raises(ValueError, match="behav_imp_weight_mode='clip'"):
        decoupled_ppo_loss(*args, behav_imp_weight_mode="clip")
    with pytest.raises(ValueError, match="behav_imp_weight_level='batch'"):
        decoupled_ppo_loss(*args, behav_imp_weight_level="batch")
