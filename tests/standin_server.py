"""A stand-in for a vLLM server on loopback, for the failures a real one cannot be made to show on demand: an error
event inside a 200 stream, a row that never finishes, a stall, a server without dev mode or with the wrong flags.

It speaks just enough of vLLM's HTTP API for `VLLMServerBackend` (health, models, server_info, version, the disk
transport's routes, streamed completions) and records every request's path.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandinServer:
    """`completions`: "ok" (every row 2 tokens, finish_reason "length"), "error" (2 tokens per row, then an error
    event and [DONE]), "unfinished" (2 tokens per row, no finish_reason, [DONE]) or "stall" (headers, then nothing
    for `stall_s`). `dev_mode`, `logprobs_mode`, `weight_transfer`, `replicas` and `version` shape /server_info and
    /version."""

    ERROR_MESSAGE = "EngineCore encountered an issue: CUDA out of memory (stand-in)"

    def __init__(
        self,
        completions="ok",
        dev_mode=True,
        logprobs_mode="processed_logprobs",
        weight_transfer=None,
        version="0.31.0",
        stall_s=30.0,
        restart_at=None,
        push_fails=False,
        lora=False,
        replicas=1,
        replica_missing_pushes=None,
    ):
        self.completions, self.dev_mode, self.version = completions, dev_mode, version
        self.replicas = replicas  # --data-parallel-size
        # /weight_checker: this replica keeps its base weights (it misses every push); None: every replica loads them
        self.replica_missing_pushes = replica_missing_pushes
        self.pushes = 0
        self.lora = lora  # started with --enable-lora --max-lora-rank 8 and runtime LoRA updating
        self.push_fails = push_fails  # /collective_rpc (the disk transport's reload) answers 500
        self.restart_at = restart_at  # the n-th completions request (1-based) finds a "restarted" server
        self.weight_version = None
        self.completion_requests = 0
        self.logprobs_mode, self.weight_transfer, self.stall_s = logprobs_mode, weight_transfer, stall_s
        self.paths: list[str] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, payload, status=200):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                standin.paths.append(self.path)
                path = self.path.split("?")[0]
                if path == "/health":
                    self._json({})
                elif path == "/v1/models":
                    self._json({"data": [{"id": "standin"}]})
                elif path == "/version":
                    self._json({"version": standin.version})
                elif path == "/weight_info" and standin.dev_mode:
                    self._json({"weight_version": standin.weight_version})
                elif path == "/server_info" and standin.dev_mode:
                    self._json(
                        {
                            "vllm_config": {
                                "model_config": {"logprobs_mode": standin.logprobs_mode},
                                "weight_transfer_config": standin.weight_transfer,
                                "lora_config": {"max_lora_rank": 8} if standin.lora else None,
                                "parallel_config": {"data_parallel_size": standin.replicas},
                            },
                            "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": standin.lora},
                        }
                    )
                else:
                    self._json({"detail": "Not Found"}, 404)

            def do_POST(self):
                standin.paths.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                path = self.path.split("?")[0]
                if path == "/v1/completions":
                    standin.completion_requests += 1
                    if standin.completion_requests == standin.restart_at:
                        standin.weight_version = None  # what a restarted server holds: its base weights, no label
                    self._stream(len(body["prompt"]))
                elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and standin.lora:
                    self._json({})
                elif path == "/update_weight_version" and standin.dev_mode:
                    standin.weight_version = body["new_version"]
                    self._json({"success": True, "new_version": body["new_version"]})
                elif path == "/collective_rpc" and standin.push_fails:
                    self._json({"error": {"message": "reload_weights failed: out of memory (stand-in)"}}, 500)
                elif path in ("/collective_rpc", "/reset_prefix_cache") and standin.dev_mode:
                    standin.pushes += path == "/collective_rpc"
                    self._json({"success": True} if path == "/reset_prefix_cache" else {})
                elif path == "/weight_checker" and standin.dev_mode:
                    pushed = {
                        replica: 0 if replica == standin.replica_missing_pushes else standin.pushes
                        for replica in range(standin.replicas)
                    }
                    checksums = {
                        f"dp{replica}:pp0:pcp0:tp0:{name}": f"{name}-after-{pushes}-pushes"
                        for replica, pushes in pushed.items()
                        for name in ("model.embed_tokens.weight", "model.norm.weight")
                    }
                    self._json({"checksums": checksums})
                else:
                    self._json({"detail": "Not Found"}, 404)

            def _stream(self, rows):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                if standin.completions == "stall":
                    time.sleep(standin.stall_s)
                    return
                for step in range(2):
                    for row in range(rows):
                        last = step == 1 and standin.completions == "ok"
                        choice = {
                            "index": row,
                            "token_ids": [5 + step],
                            "logprobs": {"token_logprobs": [-0.5]},
                            "finish_reason": "length" if last else None,
                        }
                        self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                if standin.completions == "error":
                    error = {"error": {"message": standin.ERROR_MESSAGE, "type": "InternalServerError", "code": 500}}
                    self.wfile.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="standin-vllm", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)
