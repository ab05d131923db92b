"""The vLLM server backend against a real `vllm serve` (CPU build), started by the fixture on loopback."""

import os
import socket
from pathlib import Path

import pytest
import torch
from conftest import digit_reward, make_tokenizer
from test_trainer import COMMON, logged
from transformers import AutoModelForCausalLM, Qwen2Config

from trl_a3po import A3POConfig, A3POTrainer
from trl_a3po.rollout import PolicyWeights
from trl_a3po.rollout.vllm_server import VLLMServerBackend, local_vllm_server

REPO = Path(__file__).resolve().parent.parent


def vllm_python() -> str | None:
    candidate = os.environ.get("A3PO_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    return candidate if Path(candidate).exists() else None


def make_server_model(tokenizer):
    # vLLM's CPU attention needs a supported head size (32 here): a little wider than the other tests' model.
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    python = vllm_python()
    if python is None:
        if os.environ.get("A3PO_REQUIRE_VLLM"):
            pytest.fail("A3PO_REQUIRE_VLLM is set but no vLLM venv was found (.venv-vllm or A3PO_VLLM_PYTHON)")
        pytest.skip("no vLLM venv (.ci/run installs one in .venv-vllm)")
    root = tmp_path_factory.mktemp("vllm")
    model_dir = root / "model"
    tokenizer = make_tokenizer()
    make_server_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with local_vllm_server(python, str(model_dir), port, str(root), max_model_len=512, timeout_s=300,
                           env={"HF_HUB_OFFLINE": "1"}):
        yield {"port": port, "model_dir": model_dir, "tokenizer": tokenizer}


def make_trainer(tmp_path, server, prompt_dataset, **kwargs):
    args = A3POConfig(output_dir=str(tmp_path), rollout_backend="vllm_server", vllm_server_port=server["port"],
                      **{**COMMON, **kwargs})
    model = AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32)
    return A3POTrainer(model=model, reward_funcs=digit_reward, args=args, train_dataset=prompt_dataset,
                       processing_class=server["tokenizer"])


def server_vs_trainer_logprob_error(backend, trainer, prompt):
    batch = backend.generate([prompt] * 4, min_version=backend.version)
    errors = []
    for completion, logprobs in zip(batch.completion_ids, batch.logprobs):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / trainer.args.temperature
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        errors.append((expected - torch.tensor(logprobs)).abs().max().item())
    return max(errors)


def test_disk_sync_makes_the_server_match_the_trainers_weights(tmp_path, vllm_server, prompt_dataset):
    trainer = make_trainer(tmp_path, vllm_server, prompt_dataset)
    weights = PolicyWeights(trainer._policy_tensors)
    backend = VLLMServerBackend.from_config(trainer.args, weights, list(trainer.eos_token_ids))
    prompt = vllm_server["tokenizer"]("Question 7: what is 7 plus 8?").input_ids
    trainer.model.eval()
    with torch.no_grad():  # the trainer moves away from the weights the server started with
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend.version = 0  # pretend the server is current, to measure the mismatch before the push
    assert server_vs_trainer_logprob_error(backend, trainer, prompt) > 1e-2
    seconds = backend.push_weights()
    assert seconds > 0
    assert server_vs_trainer_logprob_error(backend, trainer, prompt) < 1e-4
    backend.close()


def test_async_training_on_the_vllm_server_respects_the_bound(tmp_path, vllm_server, prompt_dataset):
    trainer = make_trainer(tmp_path, vllm_server, prompt_dataset, steps_per_generation=2, max_steps=6,
                           weight_sync_transport="disk")
    trainer.train()
    staleness = logged(trainer, "a3po/staleness/max")
    assert len(staleness) == 6 and max(staleness) <= trainer.args.max_staleness == 2
    assert all(s > 0 for s in logged(trainer, "a3po/gen/weight_sync_s"))  # pushed before every batch
    # at staleness <= 1 the proximal policy is the behaviour policy: weight exactly 1
    for d, w_min, w_max in zip(staleness, logged(trainer, "a3po/behav_imp_weight/min"),
                               logged(trainer, "a3po/behav_imp_weight/max")):
        if d <= 1:
            assert w_min == pytest.approx(1.0) and w_max == pytest.approx(1.0)
    assert trainer._queue is None


def test_greedy_eval_on_the_vllm_server_matches_hf_generate(vllm_server, tmp_path):
    from trl_a3po import gsm8k_greedy_accuracy, load_gsm8k
    from trl_a3po.evaluation import _render, generate_greedy_hf, generate_greedy_vllm
    from trl_a3po.rollout.vllm_server import DiskTransport

    url = f"http://127.0.0.1:{vllm_server['port']}"
    tokenizer = vllm_server["tokenizer"]
    model = AutoModelForCausalLM.from_pretrained(vllm_server["model_dir"], dtype=torch.float32).eval()
    # earlier tests trained the server's weights: put the folder's weights back first
    backend = VLLMServerBackend(url, PolicyWeights(model.state_dict), DiskTransport(str(tmp_path)), sampling={})
    backend.push_weights()
    dataset = load_gsm8k(str(REPO / "recipes" / "data" / "gsm8k"), "test", limit=4)
    result = gsm8k_greedy_accuracy(dataset, tokenizer, vllm_base_url=url, batch_size=2, max_new_tokens=8,
                                   progress=False)
    assert result["total"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    prompt_ids = _render(tokenizer, dataset["prompt"])
    assert generate_greedy_vllm(url, prompt_ids, 8) == generate_greedy_hf(model, tokenizer, prompt_ids, 8)
    backend.close()
