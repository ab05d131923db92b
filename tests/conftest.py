"""Tiny models and a locally trained tokenizer: the tests run offline, on CPU, in seconds."""

import os
import socket
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Weng earns 12 dollars an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Betty is saving money for a new wallet which costs 100 dollars. #### 5",
    "James writes a 3-page letter to 2 different friends twice a week. \\boxed{624}",
    "0 1 2 3 4 5 6 7 8 9 10 + - * / = . , ? ! $ %",
] * 4


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<eos>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    return tokenizer


def make_model(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def free_port() -> int:
    """A TCP port free on loopback now (for a server, a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def producer_threads() -> list:
    """The generation threads alive now: producers ("a3po-producer") and continuous generation's streams."""
    return [t for t in threading.enumerate()
            if (t.name == "a3po-producer" or t.name.startswith("a3po-stream")) and t.is_alive()]


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def model(tokenizer):
    return make_model(tokenizer)


@pytest.fixture
def prompt_dataset():
    questions = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(24)]
    return Dataset.from_dict({"prompt": questions})


def digit_reward(completions, **kwargs):
    """A deterministic reward with spread inside each group: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def require_deepspeed():
    """DeepSpeed comes with the test set-up (`scripts/setup.sh --with-vllm`); CI (A3PO_REQUIRE_VLLM) must have it."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        if os.environ.get("A3PO_REQUIRE_VLLM"):
            pytest.fail("A3PO_REQUIRE_VLLM is set but DeepSpeed is not installed (scripts/setup.sh --with-vllm)")
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh --with-vllm installs it)")


@pytest.fixture(scope="session")
def synchronous_shards(tmp_path_factory):
    """The prompts each of two processes trains synchronously (in-process generation, DDP over gloo)."""
    from test_accelerate import launch

    return launch(tmp_path_factory.mktemp("sync"), "sync")
