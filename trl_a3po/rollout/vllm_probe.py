"""The vLLM server backend's start-up probe: before any weight moves, check that the server was started the way the
backend needs (dev-mode routes, processed log-probs, a tested release, LoRA loading, the transport's own needs) and
say what is missing with the command that fixes it. DESIGN.md, "The vLLM server"."""

from __future__ import annotations

import ipaddress
import logging
import socket
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import requests

from .errors import VLLMServerError, VLLMServerSetupError
from .weight_transport import version_tuple


if TYPE_CHECKING:
    from .vllm_server import VLLMServerBackend

logger = logging.getLogger(__name__)

# The vLLM releases the real-server tests passed with (CI runs the newest; scripts/test_vllm_release.sh another).
TESTED_RELEASES = ((0, 31), (0, 32))
# From 0.32 data-parallel engines seed their samplers apart (seed, replica index); before, all alike. 0.32 also has
# /weight_checker (per-replica checksums of the served weights).
_DP_SEEDED_APART = _WEIGHT_CHECKER = (0, 32)


@dataclass(frozen=True)
class ServerFacts:
    """What the probe found that the backend adapts to."""

    labels: bool  # /weight_info exists: each push is labelled and read back after every generation
    checked_replicas: int  # data-parallel replicas whose weights are compared after a merged push (1: none)
    adapters: bool  # LoRA adapters are sent (a PEFT policy whose server loads them at run time)


def probe_server(backend: VLLMServerBackend) -> ServerFacts:
    """Check, before any weight is pushed, that the server was started the way `backend` needs (raises
    `VLLMServerSetupError` naming the missing flag and the command); returns what the backend adapts to."""
    try:
        response = backend.session.get(
            f"{backend.base_url}/server_info", params={"config_format": "json"}, timeout=backend.timeout
        )
    except requests.RequestException as error:
        raise backend.http_error("probing /server_info", error) from error
    if response.status_code == 404:
        raise VLLMServerSetupError(
            f"The vLLM server at {backend.where} was started without VLLM_SERVER_DEV_MODE=1: its development routes "
            f"({backend.transport.needs}) answer 404, and the {backend.transport.name} weight transfer needs them. "
            f"Restart it with VLLM_SERVER_DEV_MODE=1 in its environment (`trl vllm-serve` sets it): "
            f"{backend.server_command()}"
        )
    if response.status_code != 200:
        raise VLLMServerError(
            f"The vLLM server at {backend.where} failed /server_info: {response.status_code} {response.text[:500]}"
        )
    config = response.json()["vllm_config"]
    logprobs_mode = (config.get("model_config") or {}).get("logprobs_mode")
    if logprobs_mode != "processed_logprobs":
        raise VLLMServerSetupError(
            f"The vLLM server at {backend.where} returns {logprobs_mode!r} log-probs; the behaviour policy is the "
            "distribution it samples from (temperature, top-p, top-k applied). Restart it with --logprobs-mode "
            f"processed_logprobs (`trl vllm-serve` adds it): {backend.server_command()}"
        )
    server_version = backend.request("reading its version", "GET", "/version").get("version", "unknown")
    replicas = int((config.get("parallel_config") or {}).get("data_parallel_size") or 1)
    checked_replicas = _check_release(backend, server_version, replicas)
    adapters = backend.lora is not None and _adapters_loadable(
        backend, config, response.json().get("vllm_env") or {}, replicas
    )
    if not adapters:  # whole weights move: the transport's own requirements
        backend.transport.check_server(backend, config, server_version)
    _warn_if_dev_routes_open(backend)
    labels = backend.session.get(f"{backend.base_url}/weight_info", timeout=backend.timeout).status_code != 404
    if not labels:
        warnings.warn(
            f"The vLLM server at {backend.where} (vLLM {server_version}) has no /weight_info route: a "
            "restart of the server during training cannot be detected. Use vLLM >= 0.31.",
            stacklevel=2,
        )
    return ServerFacts(labels=labels, checked_replicas=checked_replicas, adapters=adapters)


def _check_release(backend: VLLMServerBackend, server_version: str, replicas: int) -> int:
    """The server's vLLM release against what this backend was tested with and what its `replicas`
    (--data-parallel-size) do; returns how many replicas' weights can be compared after a push (1: none)."""
    try:
        release = version_tuple(server_version)
    except ValueError:
        return 1  # a development build: nothing to compare
    if replicas > 1 and release < _DP_SEEDED_APART:
        # Before 0.32 every data-parallel engine seeded its sampler with the same seed: the copies of a prompt
        # that the server's load balancer spreads over the replicas come back as one sample, twice.
        raise VLLMServerSetupError(
            f"The vLLM server at {backend.where} runs {replicas} data-parallel replicas on vLLM {server_version}, "
            "whose replicas seed their samplers alike: the num_generations copies of a prompt that land on "
            "different replicas would be sampled identically. Use vLLM >= 0.32 (replicas seeded apart) on the "
            "server, or restart it with --data-parallel-size 1."
        )
    if release > TESTED_RELEASES[-1]:
        warnings.warn(
            f"The vLLM server at {backend.where} runs vLLM {server_version}; trl-a3po was tested with vLLM "
            f"{', '.join('.'.join(map(str, r)) for r in TESTED_RELEASES)} (benchmarks/RESULTS.md, 'vLLM "
            "releases'). Its routes are probed above; the in-flight behaviour of newer releases is not.",
            stacklevel=3,
        )
    return replicas if replicas > 1 and release >= _WEIGHT_CHECKER else 1


def _adapters_loadable(backend: VLLMServerBackend, config: dict, env: dict, replicas: int) -> bool:
    """Whether the server loads LoRA adapters at run time; if not: refused (lora_weight_sync='adapter'), or a
    warning that merged weights are sent instead ('auto')."""
    rank = backend.lora["config"].r
    lora_config = config.get("lora_config") or {}
    missing = []
    if not lora_config:
        missing.append("--enable-lora")
    elif int(lora_config.get("max_lora_rank") or 0) < rank:
        missing.append(f"--max-lora-rank {rank} (it has {lora_config.get('max_lora_rank')})")
    if str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() not in ("true", "1"):
        missing.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (adapters loaded at run time)")
        if replicas > 1:
            # vLLM refuses runtime LoRA loading behind several API servers, its default with data parallelism
            missing.append("--api-server-count 1 (with --data-parallel-size)")
    if not missing:
        return True
    fix = ", ".join(missing)
    if backend.lora["sync"] == "adapter":
        raise VLLMServerSetupError(
            f"lora_weight_sync='adapter': the vLLM server at {backend.where} cannot load LoRA adapters at run time. "
            f"Restart it with {fix}: "
            + backend.server_command(
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ", f" --enable-lora --max-lora-rank {max(rank, 8)}"
            )
            + "; or set lora_weight_sync='merged'."
        )
    logger.warning(
        "lora_weight_sync='auto': sending merged weights, the vLLM server at %s lacks %s.", backend.where, fix
    )
    return False


def _warn_if_dev_routes_open(backend: VLLMServerBackend) -> None:
    """A server beyond loopback whose development routes answer without the API key (vLLM checks the key only
    on /v1, /v2, /inference and /cohere): say once what anyone reaching it can do, and how to close it."""
    if _is_loopback(urlparse(backend.base_url).hostname):
        return
    try:  # a request of its own, without the key
        open_to_all = requests.get(f"{backend.base_url}/server_info", timeout=backend.timeout).status_code == 200
    except requests.RequestException:
        return
    if open_to_all:
        logger.warning(
            "The vLLM server at %s answers its development routes without an API key (vLLM checks the key on /v1, "
            "/v2, /inference and /cohere only): anyone who reaches that port can read its configuration "
            "(/server_info), replace its weights and call methods in its workers (/collective_rpc, "
            "/update_weights). Bind it to a private interface (`--host`), or put an authenticating proxy in "
            "front of it.",
            backend.where,
        )


def _is_loopback(host: str | None) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host or "localhost")).is_loopback
    except (OSError, ValueError):
        return False
