"""The tests' fixtures (helpers: testing_utils.py)."""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from testing_utils import (  # noqa: E402
    launch,
    make_model,
    make_tokenizer,
    make_tool_model,
    make_tool_tokenizer,
)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def model(tokenizer):
    return make_model(tokenizer)


@pytest.fixture(scope="session")
def tool_tokenizer():
    return make_tool_tokenizer()


@pytest.fixture(scope="session")
def tool_model_weights(tool_tokenizer):
    return make_tool_model(tool_tokenizer).state_dict()


@pytest.fixture
def tool_model(tool_tokenizer, tool_model_weights):
    """In float64: episodes are long (a 230-token tool prompt, several turns), and in float32 a batched, left-padded,
    KV-cached generation and a full forward of the same weights already differ by ~2e-5 in a token's log-prob, more
    than the 1e-5 the per-token version checks resolve."""
    model = make_tool_model(tool_tokenizer, steps=0)
    model.load_state_dict(tool_model_weights)
    return model.to(torch.float64)


@pytest.fixture
def prompt_dataset():
    questions = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(24)]
    return Dataset.from_dict({"prompt": questions})


@pytest.fixture(scope="session")
def synchronous_shards(tmp_path_factory):
    """The prompts each of two processes trains synchronously (in-process generation, DDP over gloo)."""
    return launch(tmp_path_factory.mktemp("sync"), "sync")


@pytest.fixture(scope="session")
def synchronous_iterable_shards(tmp_path_factory):
    """`synchronous_shards` with the dataset streamed (an IterableDataset: TRL's own order, a buffered shuffle)."""
    return launch(tmp_path_factory.mktemp("sync-iterable"), "sync-iterable")


# ---------------------------------------------------------------- helpers shared by test modules and tests/scripts
