"""LoRA weight sync to a vLLM server, adapter vs merged: push time and bytes per version, side by side in one run.

    python benchmarks/lora_sync.py          # SmolLM2-135M-Instruct, LoRA r=16 on q/k/v/o, CPU vLLM server (~2 min)

Starts a CPU vLLM server (`.venv-vllm`, LoRA enabled), builds the PEFT policy, and pushes `--versions` versions
through the real backend each way (`lora_weight_sync` "adapter": the adapter's folder + /v1/load_lora_adapter;
"merged": W + scale * B @ A for every layer, safetensors + reload_weights), moving the adapter a little between
versions and generating a few tokens after each push (so every version is really served). Prints one table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trl_a3po import A3POConfig, resolve_model


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from trl_a3po.rollout.policy_weights import _hf_named_tensors  # noqa: E402
from trl_a3po.rollout.vllm_server import VLLMServerBackend  # noqa: E402

from local_vllm import local_vllm_server  # noqa: E402


def push_versions(mode: str, model, port: int, workdir: str, versions: int) -> dict:
    args = A3POConfig(
        output_dir=os.path.join(workdir, mode),
        rollout_backend="vllm_server",
        vllm_server_port=port,
        weight_sync_transport="disk",
        lora_weight_sync=mode,
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=4,
    )
    backend = VLLMServerBackend.from_config(args, eos_token_ids=[2], peft_configs=model.peft_config)
    assert backend.sync_mode == mode, backend.sync_mode
    seconds, sizes = [], []
    for _ in range(versions):
        with torch.no_grad():  # a new version: the adapter moves
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.add_(0.01 * torch.randn_like(param))
        if mode == "adapter":
            from peft import get_peft_model_state_dict

            tensors = get_peft_model_state_dict(model)
        else:
            tensors = _hf_named_tensors(model)
        staged = backend.stage(tensors)
        seconds.append(backend.load(staged))
        sizes.append(sum(t.numel() * t.element_size() for t in staged.tensors.values()))
        ids, _ = backend.generate([[1, 2, 3, 4]], threading.Event())
        assert len(ids[0]) >= 1
    backend.close()
    return {"mode": mode, "push_s": statistics.median(seconds), "mb": statistics.median(sizes) / 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    )
    workdir = tempfile.mkdtemp(prefix="lora-", dir="/tmp")  # short: vLLM's engine sockets live under it
    env = {"HF_HUB_OFFLINE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    start = time.perf_counter()
    with local_vllm_server(
        str(REPO / ".venv-vllm" / "bin" / "python"),
        model_dir,
        args.port,
        workdir,
        env=env,
        extra_args=("--enable-lora", "--max-lora-rank", str(max(args.rank, 8)), "--max-loras", "2"),
    ):
        print(f"server up in {time.perf_counter() - start:.0f} s")
        results = [push_versions(mode, model, args.port, workdir, args.versions) for mode in ("adapter", "merged")]
    print(
        f"\nmodel={args.model} LoRA r={args.rank} on q/k/v/o, {args.versions} versions each, CPU vLLM server "
        f"(disk), threads={torch.get_num_threads()}"
    )
    print(f"{'sync':<9}{'push s/version (median)':>25}{'MB/version':>12}")
    for r in results:
        print(f"{r['mode']:<9}{r['push_s']:>25.3f}{r['mb']:>12.1f}")
    adapter, merged = results
    print(
        f"ratios: merged/adapter push time {merged['push_s'] / adapter['push_s']:.1f}x, "
        f"bytes {merged['mb'] / adapter['mb']:.0f}x"
    )


if __name__ == "__main__":
    main()
