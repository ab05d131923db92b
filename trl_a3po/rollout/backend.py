"""The generators the producer can drive, by name: one registry that config validation and the trainer side read.

A backend is a class that declares `RolloutBackend` (stage / load a version, generate, close). A
registry row (`BackendEntry`) says how to build one from a `BackendContext`, and what it can do, as data: whether the
main process generates for every process (a server: one owner of its weights) or each process generates its own
share, and whether it honours in-flight weight updates and continuous generation (both need `generate_until`
stopping between two tokens) and LoRA adapters. Nothing outside this module branches on a backend's name to build it.
A new backend is one `register_backend` call (a benchmark's emulated engine, a user's own engine).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Generation:
    """Generated rows, in request order: per row, the token ids, each token's behaviour log-prob (from the distribution
    it was sampled from) and the policy version whose weights sampled it. The three travel together from the producer
    to TRL's scoring; a backend returns ids and log-probs only (it does not know versions: the queue does)."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]

    @classmethod
    def empty(cls, rows: int) -> Generation:
        return cls([[] for _ in range(rows)], [[] for _ in range(rows)], [[] for _ in range(rows)])

    @classmethod
    def sampled_by(cls, version: int, ids: list[list[int]], logprobs: list[list[float]]) -> Generation:
        """What a backend returned for one request, every token sampled by `version`."""
        return cls(ids, logprobs, [[version] * len(row) for row in ids])

    def extend_row(self, row: int, ids: list[int], logprobs: list[float], version: int) -> None:
        """Row `row` continues with `ids`, sampled by `version` (a generation resumed under newer weights)."""
        self.ids[row] += ids
        self.logprobs[row] += logprobs
        self.versions[row] += [version] * len(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows: slice) -> Generation:
        return Generation(self.ids[rows], self.logprobs[rows], self.versions[rows])

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.ids))


class RolloutBackend(Protocol):
    """What the producer drives. `stage` runs on the trainer's main thread (a private copy of the weights in the
    form the generator wants: device, dtype); `load` and `generate` run in the producer thread."""

    def stage(self, named_tensors: Mapping[str, object] | Iterable[tuple[str, object]]) -> object: ...

    def load(self, staged: object) -> float:  # returns the seconds it took
        ...

    def generate(
        self, prompt_ids: list[list[int]], stop: threading.Event
    ) -> tuple[list[list[int]], list[list[float]]]: ...

    # In-flight updates and continuous generation: stop once `interrupt()` says so (between two tokens); row r's
    # prompt ends with `generated[r]` tokens sampled before. Returns ids, log-probs, per row whether unfinished.
    def generate_until(
        self, prompt_ids: list[list[int]], stop: threading.Event, interrupt, generated: list[int]
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        raise NotImplementedError(
            f"{type(self).__name__} does not stop between two tokens: its registry entry must say "
            "inflight_updates=False, continuous_generation=False (config then refuses both)"
        )

    serves_concurrent_requests: bool  # several `generate_until` calls at once (a server), or one at a time

    def close(self) -> None: ...


@dataclass(frozen=True)
class BackendContext:
    """What a factory gets, on each process that runs a producer (the trainer's main thread)."""

    args: Any  # the A3POConfig
    model: Any  # the policy, unwrapped from Accelerate (a PEFT model stays one)
    generation_config: Any  # the trainer's: TRL's sampling settings
    pad_token_id: int
    eos_token_ids: list[int]
    device: Any  # this process's torch.device

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size


@dataclass(frozen=True)
class BackendEntry:
    factory: Callable[[BackendContext], Any]
    serves_every_process: bool = False  # the main process generates every process's share (a server)
    inflight_updates: bool = True  # `generate_until` stops between two tokens for a newer version
    continuous_generation: bool = True  # several batches at once (merged, or concurrent requests)
    adapters: bool = False  # receives a LoRA adapter alone (lora_weight_sync='adapter')
    # With adapters: why it cannot serve a PEFT policy's adapters ({name: config}) as they are, or None
    unservable_adapter: Callable[[dict], str | None] = lambda peft_configs: None
    compiles_generation: bool = False  # honours generation_compile (HF generate's compiled decode step)
    # Its own refusals of A3POConfig's fields (run by A3POConfig's validation): raises ValueError naming the field
    check_config: Callable[[Any], None] = lambda args: None


def _inprocess(context: BackendContext):
    from accelerate.utils import is_peft_model

    from .inprocess import InProcessBackend, build_whole_snapshot

    model, args = context.model, context.args
    base = model.get_base_model() if is_peft_model(model) else model
    compiled = args.generation_compile if args.generation_compile is not None else context.device.type == "cuda"
    return InProcessBackend(
        build_whole_snapshot(base, context.device),
        context.generation_config,
        pad_token_id=context.pad_token_id,
        eos_token_ids=context.eos_token_ids,
        compiled=compiled,
    )


def _vllm_server(context: BackendContext):
    from accelerate.utils import is_peft_model

    from .vllm_server import VLLMServerBackend

    model = context.model
    peft_configs = model.peft_config if is_peft_model(model) else None
    return VLLMServerBackend.from_config(context.args, context.eos_token_ids, peft_configs=peft_configs)


def _unservable_by_vllm(peft_configs: dict) -> str | None:
    from .vllm_server import adapter_unservable_reason

    return adapter_unservable_reason(peft_configs)


def refuse_fields(table: dict[str, tuple[bool, str]], context: str = "") -> None:
    """Raise for the first field of `table` ({name: (refused, reason)}) that is refused, naming it and the reason
    (A3POConfig's refusals and a backend's own `check_config`)."""
    for name, (refused, reason) in table.items():
        if refused:
            raise ValueError(f"A3POConfig.{name}{' ' + context if context else ': '}{reason}.")


def _refuse_what_the_colocated_engine_lacks(args) -> None:
    refused = {
        "inflight_weight_updates": (
            args.inflight_weight_updates,
            "switches versions inside a generation; the colocated engine loads a version between two "
            "generations only. Set inflight_weight_updates=False, or use a vLLM server",
        ),
        "continuous_generation": (
            args.continuous_generation,
            "streams several batches as concurrent requests; the colocated engine generates one batch at a time. "
            "Set continuous_generation=False, or use a vLLM server",
        ),
        "vllm_tensor_parallel_size": (
            args.vllm_tensor_parallel_size != 1,
            "splits the engine over several training processes, whose collectives the producer thread would run "
            "beside the trainer's. Set vllm_tensor_parallel_size=1, or serve a tensor-parallel model with "
            "`trl vllm-serve --tensor_parallel_size N` and vllm_mode='server'",
        ),
        "vllm_enable_sleep_mode": (
            args.vllm_enable_sleep_mode,
            "frees the engine's memory while the trainer steps, but generated ahead the engine works while the "
            "trainer steps. Set vllm_enable_sleep_mode=False (lower vllm_gpu_memory_utilization to make room), or "
            "async_generation=False for TRL's synchronous colocated vLLM",
        ),
    }
    refuse_fields(refused, "with the colocated vLLM engine (vllm_mode='colocate'): ")


def _vllm_colocate(context: BackendContext):
    from .vllm_colocate import VLLMColocateBackend

    return VLLMColocateBackend.from_config(context.args, context.model, context.eos_token_ids, context.device)


DEFAULT_BACKEND = "inprocess"
_REGISTRY: dict[str, BackendEntry] = {
    "inprocess": BackendEntry(_inprocess, compiles_generation=True),
    "vllm_server": BackendEntry(
        _vllm_server, serves_every_process=True, adapters=True, unservable_adapter=_unservable_by_vllm
    ),
    # vLLM's engine steps every request it holds: one request at a time, no stop between tokens for a version
    "vllm_colocate": BackendEntry(
        _vllm_colocate,
        inflight_updates=False,
        continuous_generation=False,
        check_config=_refuse_what_the_colocated_engine_lacks,
    ),
}
BUILTIN_BACKENDS = tuple(_REGISTRY)


def register_backend(name: str, factory: Callable[[BackendContext], Any], **capabilities) -> None:
    """Make `rollout_backend=name` build its generator with `factory(context)`; `capabilities`: `BackendEntry`'s
    fields (a backend generates its own share on every process unless `serves_every_process=True`)."""
    if name in BUILTIN_BACKENDS:
        raise ValueError(f"rollout_backend {name!r} is built in; register the backend under another name.")
    _REGISTRY[name] = BackendEntry(factory, **capabilities)


def backend_entry(name: str) -> BackendEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"rollout_backend={name!r} is not supported; use one of {backend_names()} (or register yours: "
            "trl_a3po.rollout.register_backend)."
        ) from None


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
