"""Backends registered from outside the library, by name: a benchmark's emulated engine, a user's own engine.

A registered backend is built by its factory, `factory(args, *, vocab_size, eos_token_ids, device)`, and must do
what `queue.RolloutBackend` declares; like the in-process generator it runs in every training process (each generates
its own share). Config validation accepts its name for `rollout_backend`, and the trainer side builds it here. The
built-in backends keep their own construction for now.
"""

from __future__ import annotations

from collections.abc import Callable


BUILTIN_BACKENDS = ("inprocess", "vllm_server", "vllm_colocate")
_FACTORIES: dict[str, Callable] = {}


def register_backend(name: str, factory: Callable) -> None:
    """Make `rollout_backend=name` build its generator with `factory` (see the module's docstring)."""
    if name in BUILTIN_BACKENDS:
        raise ValueError(f"rollout_backend {name!r} is built in; register the backend under another name.")
    _FACTORIES[name] = factory


def registered_backend(name: str) -> Callable | None:
    return _FACTORIES.get(name)


def backend_names() -> tuple[str, ...]:
    return BUILTIN_BACKENDS + tuple(_FACTORIES)
