"""Generation on a running vLLM server (`vllm serve`), with the policy's weights pushed to it between batches.

Completions come from the OpenAI-compatible `/v1/completions` endpoint with token-id prompts, the sampled token ids
(`return_token_ids`) and their log-probs (`logprobs: 0`); start the server with
`--logprobs-mode processed_logprobs` so those are the log-probs of the distribution actually sampled from.

Weights are pushed by the producer thread between two batches, so no request is ever mid-generation during a push and
every sample has exactly one behaviour version. With several training processes only the main process has a backend:
it generates every process's share (see A3POTrainer), so the server's weights have one owner. Start-up probe and
failure handling: DESIGN.md, "The vLLM server".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from urllib.parse import urlparse

import requests
import torch

from .backend import RolloutBackend
from .errors import VLLMServerError, VLLMServerSetupError, VLLMServerUnreachable
from .staging import NamedTensors, StagedWeights
from .vllm_probe import probe_server
from .weight_transport import NCCL_FLAG, DiskTransport, NCCLTransport, WeightTransport


logger = logging.getLogger(__name__)


# What a server must be started with, as the start-up probe's errors print it: TRL's own command first
# (`trl vllm-serve` runs `vllm serve` with dev mode, processed log-probs and the NCCL weight-transfer engine), then
# the `vllm serve` command it stands for. Dev mode exposes /collective_rpc (any method on the server's workers), so
# the server binds to loopback unless a trusted interface is named (docs/multi-gpu.md, several nodes;
# `trl vllm-serve`'s own default host is 0.0.0.0).
TRL_SERVE_COMMAND = "trl vllm-serve --model MODEL --host 127.0.0.1 --port {port}"
SERVER_COMMAND = (
    "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --host 127.0.0.1 --port {port} --logprobs-mode processed_logprobs"
    + NCCL_FLAG
)


def sampling_params(args, eos_token_ids: list[int]) -> dict:
    """vLLM's sampling parameters for the producer's requests, from GRPOConfig's fields (server and colocated)."""
    return {
        "max_tokens": args.max_completion_length,
        # the sampler's own temperature where it has one (A3POConfig.sampling_temperature): the processed log-probs
        # vLLM returns are then those of the cooled distribution it sampled from
        "temperature": args.temperature
        if getattr(args, "sampling_temperature", None) is None
        else args.sampling_temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k else -1,
        "min_p": args.min_p or 0.0,
        "repetition_penalty": args.repetition_penalty,
        "stop_token_ids": eos_token_ids,
        **(args.generation_kwargs or {}),
    }


def adapter_unservable_reason(peft_configs: dict) -> str | None:
    """Why a PEFT policy cannot be served as a LoRA adapter by vLLM (then its merged weights are sent), or None."""
    if len(peft_configs) != 1:
        return f"{len(peft_configs)} adapters (vLLM serves one LoRA per request)"
    (config,) = peft_configs.values()
    for field_name, what in (
        ("modules_to_save", "modules_to_save (fully trained modules are not a LoRA)"),
        ("rank_pattern", "a per-module rank_pattern"),
        ("alpha_pattern", "a per-module alpha_pattern"),
        ("layers_to_transform", "layers_to_transform"),
        ("target_parameters", "target_parameters"),
        ("trainable_token_indices", "trainable_token_indices"),
    ):
        if getattr(config, field_name, None):
            return f"LoRA with {what}, which vLLM's LoRA loader does not take"
    return None


class VLLMServerBackend(RolloutBackend):
    """Completions from a vLLM server for the producer; `load` pushes a published version's weights to the server.

    Start-up: `/health`, then a probe of what the transport needs (dev-mode routes, processed log-probs, the
    weight-transfer engine and the trainer's vLLM version for `nccl`), raising one `VLLMServerSetupError` that names
    the missing flag and the command; only then does the transport connect (NCCL's communicator).

    `api_key` (`from_config`: vLLM's own variable, `VLLM_API_KEY`) goes as a bearer token on every request, as vLLM's
    clients send it; a server that wants one and gets none (or another) is named at the probe.

    The producer calls `load` and `generate` one after the other, so no request is mid-generation during a push and
    every sample has exactly one behaviour version. Requests stream their tokens, so `close()` can abandon a
    generation at its next token. A server that sends nothing for `timeout_s` seconds (GRPOConfig's
    `vllm_server_timeout`), an error event inside the stream, or a row that ends without a normal `finish_reason`
    raises `VLLMServerError` with the server's message: nothing truncated is ever trained.
    """

    serves_concurrent_requests = True  # continuous generation streams each batch as a request of its own

    def __init__(
        self,
        base_url: str,
        transport: WeightTransport,
        sampling: dict,
        timeout_s: float = 240.0,
        connect_timeout_s: float = 5.0,
        lora: dict | None = None,
        api_key: str | None = None,
    ):
        """`lora`: for a PEFT LoRA policy, {"config": its LoraConfig, "sync": "adapter" | "auto", "folder": where the
        server reads adapters}; None sends merged weights."""
        self.base_url = base_url.rstrip("/")
        parsed = urlparse(self.base_url)
        self.where = f"{parsed.hostname}:{parsed.port}"
        self.transport = transport
        self.sampling = sampling
        self.timeout = (connect_timeout_s, timeout_s)  # requests: (connect, longest silence while reading)
        self.api_key = api_key or None
        # One requests.Session per thread that talks to the server (the producer, continuous generation's stream
        # threads): requests does not promise a Session is thread-safe. No retries: an unreachable server must fail
        # fast, not back off. `_sessions_lock` guards `_sessions` (every one opened, for close()).
        self._thread_session = threading.local()
        self._sessions: list[requests.Session] = []
        self._sessions_lock = threading.Lock()
        try:
            response = self.session.get(f"{self.base_url}/health", timeout=connect_timeout_s)
            response.raise_for_status()
        except requests.RequestException as error:
            raise VLLMServerUnreachable(
                f"The vLLM server at {self.where} is unreachable ({error.__class__.__name__}). Start it first "
                f"(docs/backends.md, 'vLLM server'): {self.server_command()}; or check vllm_server_host / "
                "vllm_server_port / vllm_server_base_url."
            ) from error
        self.model = self.request("reading the model list", "GET", "/v1/models")["data"][0]["id"]
        self.lora = lora  # None after the probe unless adapters are sent
        self._adapters: list[str] = []  # loaded on the server, oldest first; requests name the last
        # Each push labels the server's weights (vLLM's weight version) with this run's id and a push count; the
        # label is read back after every generation, so a server that restarted (base weights again) or was loaded
        # by someone else is caught before any of its completions is trained under this run's version.
        self._run_id = uuid.uuid4().hex[:8]
        self._pushes = 0
        self._weight_label: str | None = None  # what the server must hold; None before the first push
        self._labels = True  # the server has /weight_info (vLLM >= 0.2x); probed
        # Data-parallel replicas whose weights are compared after each merged push (/weight_checker, vLLM >= 0.32);
        # 1: nothing to compare (a single engine, or a release without the route). Probed.
        self._checked_replicas = 1
        facts = probe_server(self)
        self._labels, self._checked_replicas = facts.labels, facts.checked_replicas
        if not facts.adapters:
            self.lora = None
        if self.lora is None:  # adapters travel through files: no communicator for them
            self.transport.connect(self)

    @classmethod
    def from_config(cls, args, eos_token_ids: list[int], peft_configs: dict | None = None) -> VLLMServerBackend:
        """`peft_configs`: the policy's PEFT configs when it is a PEFT model (lora_weight_sync decides what moves)."""
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        transport_name = args.weight_sync_transport
        if transport_name == "auto":
            transport_name = "nccl" if torch.cuda.is_available() else "disk"
        if transport_name == "disk":
            transport = DiskTransport(args.weight_sync_dir or os.path.join(args.output_dir, "weight_sync"))
        else:
            transport = NCCLTransport(group_port=args.vllm_group_port, timeout_s=args.vllm_server_timeout)
        sampling = sampling_params(args, eos_token_ids)
        lora = None
        if peft_configs and args.lora_weight_sync != "merged":
            reason = adapter_unservable_reason(peft_configs)
            if reason is None:
                (config,) = peft_configs.values()
                folder = os.path.join(args.weight_sync_dir or os.path.join(args.output_dir, "weight_sync"), "adapters")
                lora = {"config": config, "sync": args.lora_weight_sync, "folder": os.path.abspath(folder)}
            else:  # (`adapter` with such a policy is refused before any model work: support.check_supported)
                logger.warning("lora_weight_sync='auto': sending merged weights, the policy has %s.", reason)
        return cls(
            base_url,
            transport,
            sampling,
            timeout_s=args.vllm_server_timeout,
            lora=lora,
            api_key=os.environ.get("VLLM_API_KEY"),
        )

    @property
    def sync_mode(self) -> str:
        """What each version sends: "adapter" (the LoRA alone) or "merged" (whole weights)."""
        return "adapter" if self.lora is not None else "merged"

    def server_command(self, env: str = "", extra: str = "") -> str:
        """The commands that start a server this backend can drive: `env` goes before each, `extra` after."""
        port = urlparse(self.base_url).port
        return (
            f"`{env}{TRL_SERVE_COMMAND.replace('{port}', str(port))}{extra}` (or, without TRL on the server's "
            f"machine, `{env}{SERVER_COMMAND.replace('{port}', str(port))}{extra}`)"
        )

    # -------------------------------------------------------------- HTTP

    @property
    def session(self) -> requests.Session:
        """The calling thread's session (see `__init__`)."""
        session = getattr(self._thread_session, "session", None)
        if session is None:
            session = self._thread_session.session = requests.Session()
            if self.api_key is not None:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            with self._sessions_lock:
                self._sessions.append(session)
        return session

    def request(self, doing: str, method: str, path: str, **kwargs) -> dict:
        """One request; any failure becomes a `VLLMServerError` naming the server and what was being done."""
        try:
            response = self.session.request(method, f"{self.base_url}{path}", timeout=self.timeout, **kwargs)
        except requests.RequestException as error:
            raise self.http_error(doing, error) from error
        if response.status_code == 401:
            raise self.unauthorized(f"{method} {path}")
        if response.status_code != 200:
            raise VLLMServerError(
                f"The vLLM server at {self.where} failed while {doing}: {method} {path} answered "
                f"{response.status_code} {response.text[:500]}"
            )
        if not response.content:  # some routes answer an empty body (vLLM < 0.26)
            return {}
        try:
            return response.json()
        except ValueError:  # the LoRA routes answer plain text
            return {"text": response.text}

    def post(self, path: str, payload: dict | None = None, doing: str | None = None) -> dict:
        return self.request(doing or f"calling {path}", "POST", path, json=payload)

    def unauthorized(self, request: str) -> VLLMServerSetupError:
        if self.api_key is None:
            return VLLMServerSetupError(
                f"The vLLM server at {self.where} wants an API key ({request} answered 401: it was started with "
                "--api-key or VLLM_API_KEY): set VLLM_API_KEY to that key in the training environment."
            )
        return VLLMServerSetupError(
            f"The vLLM server at {self.where} refused the API key in VLLM_API_KEY ({request} answered 401): set it to "
            "the key the server was started with."
        )

    def http_error(self, doing: str, error: Exception) -> VLLMServerError:
        if isinstance(error, requests.Timeout) or "timed out" in str(error).lower():
            return VLLMServerError(
                f"The vLLM server at {self.where} sent nothing for {self.timeout[1]:.0f} s while {doing} "
                "(vllm_server_timeout): it is stalled or overloaded. Check its log; raise vllm_server_timeout if a "
                "single step legitimately takes longer."
            )
        return VLLMServerError(
            f"The vLLM server at {self.where} went away while {doing} ({error.__class__.__name__}: {error})."
        )

    # -------------------------------------------------------------- backend interface

    def stage(self, named_tensors: NamedTensors) -> StagedWeights:
        if self.lora is not None:  # the adapter's tensors go through a folder: CPU copies
            return DiskTransport.stage(named_tensors)
        return self.transport.stage(named_tensors)

    def load(self, staged: StagedWeights) -> float:
        """Push a staged version to the server; return the seconds it took."""
        start = time.perf_counter()
        if self.lora is not None:
            self._load_adapter(staged)
            return time.perf_counter() - start
        self.transport.push(self, staged)
        self._pushes += 1
        if self._checked_replicas > 1:
            self._check_replicas_agree()
        if self._labels:
            label = f"a3po-{self._run_id}-{self._pushes}"
            self.post("/update_weight_version", {"new_version": label}, doing="labelling the pushed weights")
            self._weight_label = label
        return time.perf_counter() - start

    def _check_replicas_agree(self) -> None:
        """After a push to a data-parallel server: every replica's checksum of every served tensor (vLLM's
        /weight_checker; keys `dp<i>:pp..:tp..:<name>`) equals the other replicas'. A replica that missed the push
        would answer its share of the rows with the previous weights, under this version's number."""
        checksums = self.post("/weight_checker", {"action": "checksum"}, doing="comparing the replicas' weights")
        by_tensor: dict[str, dict[str, str]] = {}
        for key, digest in checksums.get("checksums", {}).items():
            replica, _, tensor = key.partition(":")
            by_tensor.setdefault(tensor, {})[replica] = digest
        replicas = {replica for digests in by_tensor.values() for replica in digests}
        differing = sorted(tensor for tensor, digests in by_tensor.items() if len(set(digests.values())) > 1)
        if len(replicas) < self._checked_replicas or differing:
            raise VLLMServerError(
                f"After push {self._pushes}, the data-parallel replicas of the vLLM server at {self.where} hold "
                f"different weights ({len(differing)} tensors differ, e.g. {differing[:3]}; replicas reporting: "
                f"{sorted(replicas)} of {self._checked_replicas}): a replica missed the push, and its rows would be "
                "trained under a version it does not hold. Check the server's log."
            )

    def _load_adapter(self, staged: StagedWeights) -> None:
        """The version's adapter as a new LoRA on the server (a folder in PEFT's format, then /v1/load_lora_adapter);
        the base weights never move. Older adapters are unloaded once the new one is in: the producer generates with
        the newest only, so at most two are loaded at any moment."""
        from safetensors.torch import save_file

        name = f"a3po-{self._run_id}-v{self._pushes + 1}"
        folder = os.path.join(self.lora["folder"], name)
        os.makedirs(folder, exist_ok=True)
        self.lora["config"].save_pretrained(folder)  # adapter_config.json
        save_file(staged.tensors, os.path.join(folder, "adapter_model.safetensors"))
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, doing=f"loading adapter {name}")
        self._pushes += 1
        self._adapters.append(name)
        while len(self._adapters) > 1:
            old = self._adapters.pop(0)
            self.post("/v1/unload_lora_adapter", {"lora_name": old}, doing=f"unloading adapter {old}")
            shutil.rmtree(os.path.join(self.lora["folder"], old), ignore_errors=True)

    @property
    def served_model(self) -> str:
        """The name requests use: the newest adapter, or the server's model."""
        return self._adapters[-1] if self._adapters else self.model

    def _check_weights_unchanged(self, doing: str) -> None:
        if self._weight_label is None:
            return
        held = self.request("reading its weight version", "GET", "/weight_info").get("weight_version")
        if held != self._weight_label:
            raise VLLMServerError(
                f"The vLLM server at {self.where} holds weights labelled {held!r}, not the ones this run pushed "
                f"({self._weight_label!r}): it restarted, or another client loaded weights, before or while "
                f"{doing}. Those completions are discarded rather than trained under the wrong policy version; "
                "restart training from the last checkpoint (docs/reliability.md)."
            )

    def generate(self, prompt_ids: list[list[int]], stop: threading.Event):
        completion_ids, logprobs, finish_reasons, _ = self._stream(prompt_ids, stop, None, self.sampling["max_tokens"])
        if stop.is_set():
            return completion_ids, logprobs  # abandoned: the caller discards it
        unfinished = [row for row, reason in enumerate(finish_reasons) if reason not in ("stop", "length")]
        if unfinished:
            row = unfinished[0]
            raise VLLMServerError(
                f"The vLLM server at {self.where} ended {len(unfinished)} of {len(prompt_ids)} completions without "
                f"finishing them (prompt {row}: finish_reason {finish_reasons[row]!r} after "
                f"{len(completion_ids[row])} "
                "tokens); a truncated completion is never trained. Check the server's log."
            )
        return completion_ids, logprobs

    def generate_until(self, prompt_ids: list[list[int]], stop: threading.Event, interrupt, generated: list[int]):
        """Generate until done or `interrupt()` (asked at every streamed event); then the response is closed, which
        aborts the request on the server, and only the tokens received (all sampled by the weights the server held)
        are kept. Row r's prompt may end with `generated[r]` tokens already sampled: its budget is the rest of
        max_tokens (one request asks for the largest budget; a row past its own is cut there,
        as max_tokens would have). Returns the new tokens, their log-probs, and per row whether it is unfinished."""
        budgets = [self.sampling["max_tokens"] - done for done in generated]
        completion_ids, logprobs, finish_reasons, interrupted = self._stream(prompt_ids, stop, interrupt, max(budgets))
        unfinished = [False] * len(prompt_ids)
        if stop.is_set():
            return completion_ids, logprobs, unfinished
        for row, budget in enumerate(budgets):
            if len(completion_ids[row]) >= budget:
                del completion_ids[row][budget:], logprobs[row][budget:]
            elif finish_reasons[row] not in ("stop", "length"):
                if not interrupted:
                    raise VLLMServerError(
                        f"The vLLM server at {self.where} ended completion {row} without finishing it (finish_reason "
                        f"{finish_reasons[row]!r} after {len(completion_ids[row])} tokens). Check the server's log."
                    )
                unfinished[row] = True
        return completion_ids, logprobs, unfinished

    def _stream(self, prompt_ids: list[list[int]], stop: threading.Event, interrupt, max_tokens: int):
        """One streamed /v1/completions request; returns the token ids, log-probs and finish reasons received, and
        whether `interrupt()` ended it early. Closing the response aborts the request on the server."""
        payload = {
            "model": self.served_model,
            "prompt": prompt_ids,
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": True,
            **self.sampling,
            "max_tokens": max_tokens,
        }
        doing = f"generating {len(prompt_ids)} completions"
        completion_ids = [[] for _ in prompt_ids]
        logprobs = [[] for _ in prompt_ids]
        finish_reasons = [None] * len(prompt_ids)
        interrupted = False
        try:
            with self.session.post(
                f"{self.base_url}/v1/completions", json=payload, stream=True, timeout=self.timeout
            ) as response:
                if response.status_code == 401:
                    raise self.unauthorized("POST /v1/completions")
                if response.status_code != 200:
                    raise VLLMServerError(
                        f"The vLLM server at {self.where} refused /v1/completions: "
                        f"{response.status_code} {response.text[:500]}"
                    )
                # Server-sent events, one per step and prompt.
                for line in response.iter_lines():
                    if stop.is_set():
                        return completion_ids, logprobs, finish_reasons, False
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[len(b"data: ") :])
                    if "error" in event or event.get("object") == "error":
                        # An engine failure arrives inside the 200 stream, then [DONE]: never data.
                        error = event.get("error", event)
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise VLLMServerError(f"The vLLM server at {self.where} failed while {doing}: {message}")
                    for choice in event.get("choices", []):
                        row = choice["index"]
                        completion_ids[row].extend(choice.get("token_ids") or [])
                        # vLLM writes null for a NaN log-prob; the trainer rejects non-finite values by sample.
                        logprobs[row].extend(
                            float("nan") if lp is None else lp
                            for lp in (choice.get("logprobs") or {}).get("token_logprobs", [])
                        )
                        if choice.get("finish_reason") is not None:
                            finish_reasons[row] = choice["finish_reason"]
                    if interrupt is not None and None in finish_reasons and interrupt():
                        interrupted = True
                        break
        except requests.RequestException as error:
            raise self.http_error(doing, error) from error
        self._check_weights_unchanged(doing)
        for row, (ids, lps) in enumerate(zip(completion_ids, logprobs)):
            if len(ids) != len(lps):
                raise VLLMServerError(
                    f"The vLLM server at {self.where} returned {len(ids)} token ids but {len(lps)} "
                    f"log-probs for prompt {row}."
                )
        return completion_ids, logprobs, finish_reasons, interrupted

    def close(self) -> None:
        self.transport.close()
        with self._sessions_lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()
