"""Generation on a vLLM engine inside the training process (`vllm_mode="colocate"`), run by the producer thread.

vLLM's `LLM` is built with its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), on the trainer's
device, from the policy's checkpoint; each published version is loaded from the staged tensors in memory (vLLM's
`reload_weights` with a weights iterator: no NCCL group, no files), then the prefix cache is reset (cached prefixes
hold keys and values of the old weights). The producer drives the engine request by request (`add_request`, `step`),
so a generation stops at the next step once training ends. The behaviour log-probs are vLLM's `processed_logprobs`:
the distribution sampled from. Only the producer thread touches the engine after it is built.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import torch

from .backend import RolloutBackend
from .staging import NamedTensors, StagedWeights, as_pairs, stage_copy, wait_until_staged


class VLLMColocateError(RuntimeError):
    """The colocated engine ended a request abnormally; nothing of it is trained."""


class VLLMColocateBackend(RolloutBackend):
    """A colocated vLLM engine as the producer's generator (see the module's docstring)."""

    serves_concurrent_requests = False  # (continuous generation is refused for this backend)

    def __init__(self, model_path: str, sampling: dict, device: torch.device, engine_args: dict):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: weights loaded in memory
        from vllm import LLM, SamplingParams

        self.device = device
        self.sampling = SamplingParams(**{**sampling, "n": 1, "logprobs": 0})
        self.llm = LLM(model=model_path, logprobs_mode="processed_logprobs", **engine_args)
        self._request_ids = itertools.count()

    @classmethod
    def from_config(cls, args, model, eos_token_ids: list[int], device: torch.device) -> VLLMColocateBackend:
        from .vllm_server import sampling_params

        path = getattr(model, "name_or_path", None)
        if not path:
            raise ValueError(
                "vllm_mode='colocate' builds vLLM from the policy's checkpoint (its name or folder), and this model "
                "has none (`name_or_path` is empty): save it with save_pretrained and load it from there, or use "
                "use_vllm=False (in-process HF generate)."
            )
        engine_args = dict(
            dtype=str(model.dtype).removeprefix("torch."),
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_length,
            # TRL's colocated engine holds one generation batch's share of rows
            max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
            model_impl=args.vllm_model_impl,
            trust_remote_code=args.trust_remote_code,
            seed=args.seed + int(os.environ.get("RANK", 0)),  # each training process samples its own rows
            enforce_eager=device.type != "cuda",
        )
        return cls(path, sampling_params(args, eos_token_ids), device, engine_args)

    def stage(self, named_tensors: NamedTensors) -> StagedWeights:
        # A private copy on the trainer's device: the producer loads it while the trainer moves on.
        return stage_copy(as_pairs(named_tensors), lambda tensor: tensor.to(self.device, copy=True))

    def load(self, staged: StagedWeights) -> float:
        start = time.perf_counter()
        wait_until_staged(staged)
        # Checkpoint names and layout (HF's): vLLM fuses and repacks them as its loader does at start-up.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(staged.tensors.items())})
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def generate(self, prompt_ids: list[list[int]], stop: threading.Event):
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        request_ids = [f"a3po-{next(self._request_ids)}" for _ in prompt_ids]
        for request_id, prompt in zip(request_ids, prompt_ids):
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), self.sampling)
        finished = {}
        try:
            while len(finished) < len(request_ids):
                if stop.is_set():
                    break
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output.outputs[0]
        finally:
            unfinished = [request_id for request_id in request_ids if request_id not in finished]
            if unfinished:  # training is ending (or a step raised): free the engine's slots
                engine.abort_request(unfinished)
        if stop.is_set():
            return [[] for _ in prompt_ids], [[] for _ in prompt_ids]  # discarded by the queue
        ids, logprobs = [], []
        for request_id in request_ids:
            completion = finished[request_id]
            if completion.finish_reason not in ("stop", "length"):
                raise VLLMColocateError(
                    f"the colocated vLLM engine ended a request with finish_reason={completion.finish_reason!r}"
                )
            ids.append(list(completion.token_ids))
            logprobs.append([entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)])
        return ids, logprobs

    def close(self) -> None:
        self.llm = None  # the engine lives in this process: dropping it frees its memory
