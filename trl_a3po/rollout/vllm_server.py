"""Generation on a running vLLM server (`vllm serve`), with the policy's weights pushed to it between batches.

Completions come from the OpenAI-compatible `/v1/completions` endpoint with token-id prompts, the sampled token ids
(`return_token_ids`) and their log-probs (`logprobs: 0`); start the server with
`--logprobs-mode processed_logprobs` so those are the log-probs of the distribution actually sampled from.

Weights are pushed by the producer thread between two batches, so no request is ever mid-generation during a push and
every sample has exactly one behaviour version. With several training processes only the main process has a backend:
it generates every process's share (see A3POTrainer), so the server's weights have one owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from urllib.parse import urlparse

import requests
import torch



class VLLMServerUnreachable(ConnectionError):
    pass


class VLLMServerBackend:
    """Completions from a vLLM server for the producer; `load` pushes a published version's weights to the server.

    The producer calls `load` and `generate` one after the other, so no request is mid-generation during a push and
    every sample has exactly one behaviour version. Requests stream their tokens, so `close()` can abandon a
    generation at its next token instead of waiting for the whole batch.
    """

    def __init__(
        self,
        base_url: str,
        transport,
        sampling: dict,
        request_timeout_s: float = 3600.0,
        connect_timeout_s: float = 5.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.transport = transport
        self.sampling = sampling
        self.request_timeout_s = request_timeout_s
        self.session = requests.Session()  # no retries: an unreachable server must fail fast, not back off
        try:
            response = self.session.get(f"{self.base_url}/health", timeout=connect_timeout_s)
            response.raise_for_status()
            self.model = self._get("/v1/models")["data"][0]["id"]
        except requests.RequestException as error:
            parsed = urlparse(self.base_url)
            raise VLLMServerUnreachable(
                f"The vLLM server at {parsed.hostname}:{parsed.port} is unreachable ({error.__class__.__name__}). "
                "Start it first (README: 'vLLM server'), or check vllm_server_host / vllm_server_port / "
                "vllm_server_base_url."
            ) from error

    @classmethod
    def from_config(cls, args, eos_token_ids: list[int]) -> VLLMServerBackend:
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        transport_name = args.weight_sync_transport
        if transport_name == "auto":
            transport_name = "nccl" if torch.cuda.is_available() else "disk"
        if transport_name == "disk":
            transport = DiskTransport(args.weight_sync_dir or os.path.join(args.output_dir, "weight_sync"))
        else:
            transport = NCCLTransport(base_url)
        sampling = {
            "max_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k else -1,
            "min_p": args.min_p or 0.0,
            "repetition_penalty": args.repetition_penalty,
            "stop_token_ids": eos_token_ids,
            **(args.generation_kwargs or {}),
        }
        return cls(base_url, transport, sampling)

    # -------------------------------------------------------------- HTTP

    def _get(self, path: str) -> dict:
        response = self.session.get(f"{self.base_url}{path}", timeout=self.request_timeout_s)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, payload: dict | None = None) -> dict:
        response = self.session.post(f"{self.base_url}{path}", json=payload, timeout=self.request_timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {path} failed: {response.status_code} {response.text[:500]}")
        return response.json()

    # -------------------------------------------------------------- backend interface

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.transport.stage(tensor) for name, tensor in tensors.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> float:
        """Push a staged version to the server; return the seconds it took."""
        start = time.perf_counter()
        self.transport.push(self, tensors)
        return time.perf_counter() - start

    def generate(self, prompt_ids: list[list[int]], stop: threading.Event):
        payload = {
            "model": self.model,
            "prompt": prompt_ids,
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": True,
            **self.sampling,
        }
        completion_ids = [[] for _ in prompt_ids]
        logprobs = [[] for _ in prompt_ids]
        with self.session.post(f"{self.base_url}/v1/completions", json=payload, stream=True,
                               timeout=self.request_timeout_s) as response:
            if response.status_code != 200:
                raise RuntimeError(f"vLLM server /v1/completions failed: {response.status_code} "
                                   f"{response.text[:500]}")
            # Server-sent events, one per step and prompt. Closing the response aborts the request on the server.
            for line in response.iter_lines():
                if stop.is_set():
                    break
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[len(b"data: "):]).get("choices", []):
                    row = choice["index"]
                    completion_ids[row].extend(choice.get("token_ids") or [])
                    # vLLM writes null for a NaN log-prob; the trainer rejects non-finite values by sample.
                    logprobs[row].extend(
                        float("nan") if lp is None else lp for lp in (choice.get("logprobs") or {}).get(
                            "token_logprobs", [])
                    )
        for row, (ids, lps) in enumerate(zip(completion_ids, logprobs)):
            if len(ids) != len(lps) and not stop.is_set():
                raise RuntimeError(f"vLLM returned {len(ids)} token ids but {len(lps)} log-probs for prompt {row}")
        return completion_ids, logprobs

    def close(self) -> None:
        self.transport.close()
        self.session.close()


class DiskTransport:
    """safetensors in a folder the server reads, then `reload_weights` and a prefix-cache reset.

    Needs the server started with VLLM_SERVER_DEV_MODE=1 (for /collective_rpc). The reset matters: cached prefixes
    would keep key/value states computed by the old weights.
    """

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        os.makedirs(self.folder, exist_ok=True)

    @staticmethod
    def stage(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", copy=True).contiguous()

    def push(self, backend: VLLMServerBackend, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        # Every tensor is written, tied ones too: vLLM's in-place reload leaves a tensor missing from the file in an
        # undefined state (a tied lm_head was seen to go stale).
        tmp = os.path.join(self.folder, "model.safetensors.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(self.folder, "model.safetensors"))  # the server never sees a partial file
        backend.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.folder}})
        backend.post("/reset_prefix_cache")

    def close(self) -> None:
        pass


class NCCLTransport:
    """TRL's NCCL weight transfer (GPU): the server needs `--weight-transfer-config '{"backend": "nccl"}'`."""

    def __init__(self, base_url: str):
        from trl.generation.vllm_client import VLLMClient  # needs `pip install trl-a3po[vllm]`

        self.client = VLLMClient(base_url=base_url, connection_timeout=10.0)
        self.client.init_communicator(device=torch.cuda.current_device())

    @staticmethod
    def stage(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()  # stays on the GPU it lives on

    def push(self, backend: VLLMServerBackend, tensors: dict[str, torch.Tensor]) -> None:
        with self.client.weight_update():
            for name, tensor in tensors.items():
                self.client.update_named_param(name, tensor)
        self.client.reset_prefix_cache()

    def close(self) -> None:
        self.client.close_communicator()


@contextlib.contextmanager
def local_vllm_server(python: str, model_dir: str, port: int, workdir: str, max_model_len: int = 1024,
                      env: dict | None = None, timeout_s: float = 600):
    """A vLLM server on this machine for `model_dir` (the tests and `benchmarks/learning.py` start one), with
    the flags this backend needs: dev mode for the disk transport's `/collective_rpc`, processed log-probs. Yields
    its base URL once `/health` answers; on exit stops its whole process group, so vLLM's engine and worker
    processes do not outlive it. `python` is a Python that has vLLM (`.venv-vllm/bin/python`); caches, RPC sockets
    and `server.log` go to `workdir`."""
    for folder in ("cache", "rpc"):
        os.makedirs(os.path.join(workdir, folder), exist_ok=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CACHE_ROOT": os.path.join(workdir, "cache"), "VLLM_RPC_BASE_PATH": os.path.join(workdir, "rpc")}
    log_path = os.path.join(workdir, "server.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
             "--model", str(model_dir), "--dtype", "float32", "--max-model-len", str(max_model_len),
             "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                with open(log_path) as f:
                    raise RuntimeError(f"vLLM server exited ({server.returncode}):\n{f.read()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                with open(log_path) as f:
                    raise TimeoutError(f"vLLM server not healthy in {timeout_s:.0f} s:\n{f.read()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
