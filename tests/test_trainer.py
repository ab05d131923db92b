"""A3POTrainer end to end on a tiny model: loss equivalences, forward counts, metrics, LoRA, errors."""

import collections
import threading

import pytest
import torch
from testing_utils import COMMON, digit_reward, handmade_batch, logged, loss_and_grads, make_model, make_trainer
from transformers import GenerationConfig, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout import generate_with_behavior_logprobs


def count_logp_forwards(monkeypatch):
    """Count GRPOTrainer's log-prob forwards (the real ones: A3POTrainer's skip of TRL's old-log-prob forward never
    reaches it), with and without autograd."""
    counts = {"grad": 0, "no_grad": 0}
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def counted(self, *args, **kwargs):
        counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counted)
    return counts


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_decoupled_loss_at_staleness_le_1_equals_grpo_with_behaviour_as_old(
    tmp_path, tokenizer, prompt_dataset, loss_type
):
    # d <= 1: prox = behav, w = 1, so the decoupled loss is GRPO's clipped loss with old = behav (no cap hit here).
    grpo = make_trainer(tmp_path / "g", tokenizer, prompt_dataset, GRPOTrainer, GRPOConfig, loss_type=loss_type)
    a3po = make_trainer(tmp_path / "a", tokenizer, prompt_dataset, loss_type=loss_type, behav_imp_weight_cap=None)
    a3po.model.load_state_dict(grpo.model.state_dict())
    batch = handmade_batch(grpo)
    for step in (0, 1):
        grpo.state.global_step = a3po.state.global_step = step
        loss_g, grad_g = loss_and_grads(grpo, batch)
        loss_a, grad_a = loss_and_grads(a3po, batch)
        assert torch.allclose(loss_a, loss_g, atol=1e-6), (loss_a, loss_g)
        assert torch.allclose(grad_a, grad_g, atol=1e-6)


def test_coupled_mode_is_grpotrainer(tmp_path, tokenizer, prompt_dataset):
    grpo = make_trainer(tmp_path / "g", tokenizer, prompt_dataset, GRPOTrainer, GRPOConfig)
    sync = make_trainer(tmp_path / "s", tokenizer, prompt_dataset, use_decoupled_loss=False)
    sync.model.load_state_dict(grpo.model.state_dict())
    batch = handmade_batch(grpo)
    loss_g, grad_g = loss_and_grads(grpo, batch)
    loss_s, grad_s = loss_and_grads(sync, batch)
    assert torch.allclose(loss_s, loss_g, atol=1e-6)
    assert torch.allclose(grad_s, grad_g, atol=1e-6)


def test_stale_batch_uses_loglinear_prox(tmp_path, tokenizer, prompt_dataset):
    # d = 4: r = (p_theta / p_behav)^(1/4) and w = (p_theta / p_behav)^(3/4); check the loss value by hand.
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, loss_type="bnpo", behav_imp_weight_cap=None)
    batch = handmade_batch(trainer, behav_noise=0.05)
    trainer.state.global_step = 4
    loss, _ = loss_and_grads(trainer, batch)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            6,
        )
    log_ratio = logp - batch["sampling_per_token_logps"]
    r, w = torch.exp(0.25 * log_ratio), torch.exp(0.75 * log_ratio)
    adv = batch["advantages"].unsqueeze(1)
    per_token = -w * torch.min(r * adv, r.clamp(0.8, 1.2) * adv)
    mask = batch["completion_mask"].float()
    assert loss.item() == pytest.approx(((per_token * mask).sum() / mask.sum()).item(), abs=1e-6)


@pytest.mark.parametrize("method", ["loglinear", "recompute", "metrics"])
def test_training_runs_counts_forwards_and_logs_metrics(tmp_path, tokenizer, prompt_dataset, method, monkeypatch):
    # Synchronous generation, 3 optimizer steps per generation batch (gradient_accumulation_steps=1): one policy
    # version per generation batch, so every sample is trained at staleness 0 and alpha 1 (the paper's d = 0).
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        prox_logp_method=method,
        steps_per_generation=3,
        max_steps=6,
        async_generation=False,
    )
    counts = count_logp_forwards(monkeypatch)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()

    assert counts["grad"] == 6  # one training forward per micro-batch
    # TRL's "old log-prob" forward is skipped; recompute runs its own, once per training step (2 generation batches)
    assert counts["no_grad"] == {"loglinear": 0, "recompute": 2, "metrics": 2}[method]
    assert logged(trainer, "a3po/staleness/mean") == [0] * 6
    assert logged(trainer, "a3po/staleness/max") == [0] * 6
    assert logged(trainer, "a3po/alpha/mean") == [1] * 6
    for key in (
        "a3po/behav_imp_weight/mean",
        "a3po/behav_imp_weight/min",
        "a3po/behav_imp_weight/max",
        "a3po/capped_frac",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "a3po/ratio/min",
        "a3po/ratio/max",
        "a3po/prox_time_s",
        "a3po/staleness/frac_d0",
    ):
        assert len(logged(trainer, key)) == 6, key
    weights = logged(trainer, "a3po/behav_imp_weight/mean")
    if method == "loglinear":  # d = 0: the proximal policy is exactly the behaviour policy
        assert weights == [1.0] * 6
    else:  # the recomputed anchor is the behaviour policy up to generate-vs-forward float noise
        assert all(w == pytest.approx(1.0, abs=1e-5) for w in weights)
    prox_time = logged(trainer, "a3po/prox_time_s")
    if method == "loglinear":
        assert all(t < 0.05 for t in prox_time)
    else:  # the recompute forward lands in the first optimizer step of each training step, and only there
        assert prox_time[0] > 0 and prox_time[3] > 0
        assert prox_time[1:3] == prox_time[4:6] == [0.0, 0.0]
    if method == "metrics":
        # Like with like: each approximation is compared with the anchor recomputed for the same training step. At
        # d = 0 all three approximations are the behaviour log-probs, so their errors are equal and float noise.
        for key in ("abs", "rel", "abs/d0"):
            errors = {m: logged(trainer, f"a3po/prox_error/{m}/{key}") for m in ("loglinear", "linear", "rollout")}
            assert len(errors["loglinear"]) == 6
            assert errors["linear"] == pytest.approx(errors["loglinear"], abs=1e-7)
            assert errors["rollout"] == pytest.approx(errors["loglinear"], abs=1e-7)
        assert max(logged(trainer, "a3po/prox_error/loglinear/abs")) < 1e-5
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "training did not change the weights"


def test_kl_penalty_keeps_the_reference_forward_while_the_old_logprob_forward_is_skipped(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    # beta > 0 and 3 optimizer steps per generation batch: TRL's scoring runs its "old log-prob" forward, then the
    # reference model's. The skip must answer the first and only the first: the reference log-probs reach the loss.
    make_model(tokenizer).save_pretrained(tmp_path / "model")  # TRL loads the reference model by name
    trainer = make_trainer(
        tmp_path / "run",
        tokenizer,
        prompt_dataset,
        model=str(tmp_path / "model"),
        steps_per_generation=3,
        max_steps=6,
        async_generation=False,
        beta=0.1,
        learning_rate=1e-2,
    )
    counts = count_logp_forwards(monkeypatch)
    trainer.train()
    assert counts == {"grad": 6, "no_grad": 2}  # the reference forward, once per generation batch
    kl = logged(trainer, "kl")
    assert len(kl) == 6
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # the first micro-batch: policy == reference
    assert kl[-1] > 1e-6  # the policy moved away from the reference, and the penalty sees it


def test_sync_loglinear_and_recompute_train_the_same_weights(tmp_path, tokenizer, prompt_dataset):
    # The paper's layout (4 optimizer steps per generation batch), synchronous: d = 0 everywhere, so loglinear's
    # anchor is the behaviour policy and recompute's is a forward of the same weights. At a learning rate where the
    # ratio clips, the two must still end with the same weights. `metrics` trains on recompute's anchor and only adds
    # logging: bit for bit recompute's weights (its sweep runs ended below recompute's twice; not from this).
    trained = {}
    for method in ("loglinear", "recompute", "metrics"):
        trainer = make_trainer(
            tmp_path / method,
            tokenizer,
            prompt_dataset,
            prox_logp_method=method,
            steps_per_generation=4,
            max_steps=8,
            async_generation=False,
            learning_rate=3e-2,
            lr_scheduler_type="constant",
            behav_imp_weight_cap=None,
        )
        trainer.train()
        assert logged(trainer, "a3po/staleness/max") == [0] * 8
        assert logged(trainer, "a3po/alpha/mean") == [1] * 8
        clipped = logged(trainer, "clip_ratio/region_mean")
        assert max(clipped) > 0.05, clipped  # the trust region is active: the anchors matter
        trained[method] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    for name, weight in trained["loglinear"].items():
        assert torch.allclose(weight, trained["recompute"][name], atol=1e-4), name
        assert torch.equal(trained["metrics"][name], trained["recompute"][name]), name


def test_metrics_mode_buckets_the_error_by_staleness(tmp_path, tokenizer, prompt_dataset):
    # Two samples at d = 2, one at d = 3, one at d = 0: each bucket's error, computed by hand.
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, prox_logp_method="metrics")
    staleness = torch.tensor([2, 3, 2, 0])
    behav = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-3.0, -1.0], [-2.0, -2.0]])
    logp = torch.tensor([[-1.4, -1.0], [-0.9, -1.5], [-1.0, -1.0], [-1.0, -3.0]])
    prox = torch.tensor([[-1.1, -1.6], [-0.6, -1.5], [-2.5, -1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    metrics = collections.defaultdict(list)
    trainer._loss_metrics.prox_approximation_errors(metrics, staleness, mask, logp, behav, prox)
    # loglinear: d=2 -> (behav + logp) / 2; d=3 -> behav/3 + 2 logp/3; d=0 -> behav
    # d=2: sample 0: prox (-1.1, -1.6) vs (-1.2, -1.5): 0.1, 0.1; sample 2 (token 0): (-2.0) vs -2.5: 0.5
    assert metrics["a3po/prox_error/loglinear/abs/d2"] == [pytest.approx(0.7 / 3)]
    # d=3: sample 1 (token 0): -0.5/3 - 1.8/3 = -0.7667 vs -0.6
    assert metrics["a3po/prox_error/loglinear/abs/d3"] == [pytest.approx(2.3 / 3 - 0.6)]
    assert metrics["a3po/prox_error/loglinear/abs/d0"] == [pytest.approx(0.0)]
    assert metrics["a3po/prox_error/rollout/abs/d2"] == [pytest.approx((0.1 + 0.4 + 0.5) / 3)]
    overall = (0.1 + 0.1 + 0.5 + (2.3 / 3 - 0.6) + 0.0 + 0.0) / 6
    assert metrics["a3po/prox_error/loglinear/abs"] == [pytest.approx(overall)]


def test_grpotrainer_would_pay_a_forward_that_loglinear_skips(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    grpo = make_trainer(
        tmp_path, tokenizer, prompt_dataset, GRPOTrainer, GRPOConfig, steps_per_generation=3, max_steps=3
    )
    counts = count_logp_forwards(monkeypatch)
    grpo.train()
    assert counts == {"grad": 3, "no_grad": 1}


def test_behaviour_logprobs_match_a_forward_of_the_generating_weights(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, temperature=0.7, async_generation=False)
    trainer.model.eval()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompt_dataset["prompt"][:4]])
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            batch["completion_ids"].size(1),
        )
    mask = batch["completion_mask"].bool()
    diff = (logp - batch["sampling_per_token_logps"]).abs()[mask]
    assert diff.max().item() < 1e-5
    assert torch.equal(batch["behavior_version"], torch.zeros_like(batch["completion_ids"]))  # every token: version 0


def test_nan_behaviour_logprob_names_the_sample(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    import trl_a3po.trainer as trainer_module

    real = trainer_module.generate_with_behavior_logprobs

    def poisoned(*args, **kwargs):
        ids, logprobs = real(*args, **kwargs)
        logprobs[2][1] = float("nan")
        return ids, logprobs

    monkeypatch.setattr(trainer_module, "generate_with_behavior_logprobs", poisoned)
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, max_steps=1, async_generation=False)
    with pytest.raises(ValueError, match=r"Non-finite behaviour log-prob \(nan\) for sample 2 .* token 1"):
        trainer.train()


def test_lora_training(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    from peft import LoraConfig

    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        steps_per_generation=2,
        max_steps=2,
        async_generation=False,
    )
    counts = count_logp_forwards(monkeypatch)
    lora_b = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b.values())  # PEFT starts B at zero
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" not in n}
    trainer.train()
    assert counts == {"grad": 2, "no_grad": 0}
    assert any(torch.count_nonzero(p) > 0 for p in lora_b.values()), "LoRA weights did not move"
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "lora" not in n)
    assert logged(trainer, "a3po/staleness/mean") == [0, 0]


def test_num_iterations_reuse_is_one_version(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    # num_iterations=2 trains each generation batch twice (4 optimizer steps): all of it is one training step, so
    # one policy version: staleness 0, and no extra forward (TRL would run its old-log-prob forward here).
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        steps_per_generation=2,
        num_iterations=2,
        max_steps=8,
        async_generation=False,
    )
    counts = count_logp_forwards(monkeypatch)
    trainer.train()
    assert logged(trainer, "a3po/staleness/mean") == [0] * 8
    assert logged(trainer, "a3po/alpha/mean") == [1] * 8
    assert counts == {"grad": 8, "no_grad": 0}
    # the proximal anchor is the behaviour policy for the whole training step: the weight stays exactly 1 while the
    # ratio moves away from 1 in the later optimizer steps of the step
    assert logged(trainer, "a3po/behav_imp_weight/max") == [1.0] * 8
    assert max(logged(trainer, "a3po/ratio/max")[1:4]) > 1.0 + 1e-4


@pytest.mark.parametrize("mode,level", [("truncate", "token"), ("mask", "sequence"), ("truncate", "sequence")])
def test_behaviour_weight_options_train(tmp_path, tokenizer, prompt_dataset, mode, level):
    # A sequence's weight is the geometric mean of its token weights, much closer to 1 than the tokens' own: tighter
    # bounds there, so that they bite at staleness 2 whatever the (thread-timed) samples were.
    low, high = (0.95, 1.05) if level == "token" else (0.995, 1.005)
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        steps_per_generation=2,
        max_steps=8,
        max_staleness=2,
        learning_rate=1e-2,
        behav_imp_weight_mode=mode,
        behav_imp_weight_level=level,
        behav_imp_weight_cap=high,
        behav_imp_weight_min=low,
    )
    trainer.train()
    staleness = logged(trainer, "a3po/staleness/max")
    for key in ("a3po/capped_frac", "a3po/below_min_frac", "a3po/seq_capped_frac", "a3po/seq_below_min_frac"):
        shares = logged(trainer, key)
        assert len(shares) == 8
        # at staleness <= 1 the weight is exactly 1 (prox = behav): nothing is outside [low, high]
        assert all(share == 0.0 for share, d in zip(shares, staleness) if d <= 1), key
    bound = [s for key in ("a3po/capped_frac", "a3po/below_min_frac") for s in logged(trainer, key)]
    assert 2 in staleness and max(bound) > 0  # at staleness 2 the tight bounds bite
    if mode == "truncate":  # truncated weights stay inside the bounds
        assert max(logged(trainer, "a3po/behav_imp_weight/max")) <= high + 1e-6
        assert min(logged(trainer, "a3po/behav_imp_weight/min")) >= low - 1e-6


def test_without_args_a3po_trainer_builds_trains_and_cites_the_paper(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    # TRL's convention: no `args` gives a config named after the model. Unlike GRPOTrainer's default (bf16, which
    # fails on a machine without a bf16 GPU), the precision follows the hardware; the model card cites A-3PO.
    model_dir = tmp_path / "tiny-policy"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    trainer = A3POTrainer(model=str(model_dir), reward_funcs=digit_reward, train_dataset=prompt_dataset)
    assert isinstance(trainer.args, A3POConfig) and trainer.args.output_dir.endswith("tiny-policy-A3PO")
    assert trainer.args.bf16 is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert trainer.args.max_staleness == 2 and trainer.args.async_generation
    # train a little: 2 steps, not the default 3 epochs, and 16 new tokens, not 256
    trainer.args.max_steps, trainer.args.report_to = 2, []
    trainer.generation_config.max_new_tokens = 16
    trainer.train()
    assert trainer.state.global_step == 2
    trainer.create_model_card()
    card = (tmp_path / "tiny-policy-A3PO" / "README.md").read_text()
    assert "A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation" in card
    assert "2512.06547" in card and "@article{li2025a3po" in card and "A3PO" in card
    assert "DeepSeekMath" not in card  # GRPOTrainer's own citation is not the one


LEAN = """
import sys
sys.modules.update(gguf=None, matplotlib=None)  # any import of them fails, as where they are not installed
sys.path.insert(0, "tests")
from testing_utils import digit_reward, make_model, make_tokenizer
from datasets import Dataset
import trl_a3po
from trl_a3po import A3POConfig, A3POTrainer
tokenizer = make_tokenizer()
args = A3POConfig(output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                  max_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no")
dataset = Dataset.from_dict({"prompt": ["What is 1 plus 2?"] * 8})
trainer = A3POTrainer(model=make_model(tokenizer), reward_funcs=digit_reward, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
trainer.train()
assert trainer.state.global_step == 1
assert sys.modules["gguf"] is None and sys.modules["matplotlib"] is None
print("lean ok")
"""


def test_the_library_trains_without_the_demo_and_plot_extras(tmp_path):
    # `pip install trl-a3po` without extras: gguf (the CPU demo's model) and matplotlib (figures) are extras, and
    # neither `import trl_a3po` nor training imports them.
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    repo = Path(__file__).resolve().parent.parent
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    required = " ".join(project["dependencies"])
    assert "gguf" not in required and "matplotlib" not in required
    assert project["optional-dependencies"]["demo"] == ["gguf"] and project["optional-dependencies"]["plot"] == [
        "matplotlib"
    ]
    result = subprocess.run(
        [sys.executable, "-c", LEAN, str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0 and "lean ok" in result.stdout, result.stderr[-3000:]


def test_metrics_are_read_from_the_device_once_per_optimizer_step(tmp_path, tokenizer, prompt_dataset, monkeypatch):
    # Every `.item()` / `.tolist()` is a device synchronisation on a GPU. The decoupled loss keeps its metrics on the
    # device and reads them all at once at the end of an optimizer step: none on the micro-batches before it.
    trainer = make_trainer(
        tmp_path, tokenizer, prompt_dataset, steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4
    )
    reads = {"accumulating": 0, "last": 0}
    inside = []

    def counting(original):
        def read(self, *args, **kwargs):
            if inside and threading.current_thread() is threading.main_thread():  # not the producer's
                reads[inside[-1]] += 1
            return original(self, *args, **kwargs)

        return read

    monkeypatch.setattr(torch.Tensor, "item", counting(torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting(torch.Tensor.tolist))
    original_loss = trainer._decoupled_loss

    def watched(model, inputs):
        inside.append("last" if trainer.accelerator.sync_gradients else "accumulating")
        try:
            return original_loss(model, inputs)
        finally:
            inside.pop()

    monkeypatch.setattr(trainer, "_decoupled_loss", watched)
    trainer.train()
    assert reads == {"accumulating": 0, "last": 4}  # one read per optimizer step (4 steps x 2 micro-batches)
    assert len(logged(trainer, "entropy")) == 4 and len(logged(trainer, "clip_ratio/region_mean")) == 4


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_reward_function_logging_a_metric_trains(tmp_path, tokenizer, prompt_dataset, decoupled):
    # TRL 1.16 hands reward functions `log_metric`; its values land in the logs under their own name.
    logged_values = []

    def reward_with_metric(completions, log_metric, **kwargs):
        rewards = digit_reward(completions)
        log_metric("digit_share_max", max(rewards))
        logged_values.append(max(rewards))
        return rewards

    trainer = make_trainer(
        tmp_path, tokenizer, prompt_dataset, reward=reward_with_metric, max_steps=2, use_decoupled_loss=decoupled
    )
    trainer.train()
    assert logged(trainer, "digit_share_max") == pytest.approx(logged_values) and len(logged_values) == 2


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"num_beams": 2}, "num_beams"),
        ({"do_sample": False}, "do_sample"),
        ({"num_return_sequences": 2}, "num_return_sequences"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
    ],
)
def test_generation_kwargs_that_do_not_sample_one_completion_are_refused_by_name(tmp_path, kwargs, key):
    with pytest.raises(ValueError, match=rf"A3POConfig.generation_kwargs\['{key}'\]"):
        A3POConfig(output_dir=str(tmp_path), **{**COMMON, "generation_kwargs": kwargs})
    # GRPOTrainer's own loss and generation keep them
    A3POConfig(output_dir=str(tmp_path), **{**COMMON, "generation_kwargs": kwargs, "use_decoupled_loss": False})


def test_other_generation_kwargs_reach_the_producer_and_its_logprobs(tmp_path, tokenizer, prompt_dataset):
    # A processor TRL has no field for: generated ahead with it, and the behaviour log-probs are still those of the
    # distribution sampled from (a banned token has log-prob -inf there, so none is ever sampled).
    banned = tokenizer.convert_tokens_to_ids("<|user|>")
    trainer = make_trainer(
        tmp_path, tokenizer, prompt_dataset, max_steps=4, generation_kwargs={"suppress_tokens": [banned]}
    )
    batches = []
    original = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: batches.append(original(inputs)) or batches[-1]
    trainer.train()
    assert batches and all(banned not in b["completion_ids"][b["completion_mask"].bool()].tolist() for b in batches)
    assert max(logged(trainer, "a3po/staleness/max")) >= 1


class TensorGenerateModel(Qwen2ForCausalLM):
    """A custom model whose `generate` returns the sequences alone, as a plain tensor."""

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        return out if isinstance(out, torch.Tensor) else out.sequences


def test_a_plain_tensor_generate_gets_the_logprobs_of_the_distribution_it_sampled(tokenizer):
    model = make_model(tokenizer)
    plain = TensorGenerateModel(model.config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    config = GenerationConfig(
        max_new_tokens=8,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        repetition_penalty=1.2,
        pad_token_id=tokenizer.pad_token_id,
    )
    prompts = [tokenizer("Question 1: what is")["input_ids"], tokenizer("Natalia sold")["input_ids"]]
    results = []
    for m in (model, plain):
        torch.manual_seed(3)
        results.append(
            generate_with_behavior_logprobs(
                m.eval(), prompts, config, tokenizer.pad_token_id, [tokenizer.eos_token_id]
            )
        )
    (ids, logprobs), (plain_ids, plain_logprobs) = results
    assert plain_ids == ids and sum(map(len, ids)) > 8
    for row, plain_row in zip(logprobs, plain_logprobs):
        assert plain_row == pytest.approx(row, abs=1e-5)


def test_a_plain_tensor_generate_trains_asynchronously(tmp_path, tokenizer, prompt_dataset):
    model = TensorGenerateModel(make_model(tokenizer).config)
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, model=model, max_steps=4)
    trainer.train()
    assert max(logged(trainer, "a3po/staleness/max")) >= 1


@pytest.mark.parametrize("async_generation", [False, True])
def test_a_cooled_sampler_reports_the_logprobs_it_sampled_from_while_the_learner_keeps_its_temperature(
    tmp_path, tokenizer, prompt_dataset, async_generation
):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        temperature=1.0,
        sampling_temperature=0.5,
        async_generation=async_generation,
        max_steps=2,
    )
    assert trainer.temperature == 1.0 and trainer.generation_config.temperature == 0.5
    samples = []
    original = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: samples.append(inputs) or original(model, inputs)
    trainer.train()  # version 0 is the initial weights: with a copy of them, the first batch's sampler is known
    batch = samples[0]
    model = make_model(tokenizer)  # the initial weights (same seed)
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        ).logits
    width = batch["prompt_ids"].size(1)
    logits = logits[:, width - 1 : -1]
    ids = batch["completion_ids"][:, :, None]
    mask = batch["completion_mask"].bool()
    at = {t: torch.log_softmax(logits / t, -1).gather(-1, ids).squeeze(-1)[mask] for t in (0.5, 1.0)}
    behaviour = batch["sampling_per_token_logps"][mask]
    assert (behaviour - at[0.5]).abs().max() < 1e-5  # the cooled distribution it sampled from
    assert (behaviour - at[1.0]).abs().max() > 1e-2  # not the learner's


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(use_decoupled_loss=False), "no behaviour weight to correct"),
        (dict(sampling_temperature=0.0), "must be > 0"),
    ],
)
def test_sampling_temperature_needs_the_decoupled_loss(tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        A3POConfig(output_dir=str(tmp_path), **{**COMMON, "sampling_temperature": 0.8, **kwargs})
