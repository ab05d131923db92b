"""The GPU check: every table in its own time box, every row a JSON line the moment it is measured, the ratios last.

    bash benchmarks/gpu_check.sh            # one GPU (the H200 of the device tool: run it as the .sh says)
    bash benchmarks/gpu_check.sh --cpu      # every table's code path with tiny shapes, on a CPU (the test suite)

Rows go to <out>/gpu_check.jsonl (<out>: $OUT when set, else --out, default outputs/gpu_check); a table that overruns
its box is stopped, a `timed_out` line says so, and the next table starts. Models are random, built on the device in
the dtype measured (bf16 on CUDA). Tables, in the order the issue's goals read them:

  decoders   HF generate vs the compiled decoder (generation_compile) through the producer's InProcessBackend:
             tok/s, first-call seconds (compilation and capture), recompilations across a new version, peak memory
  inprocess  the real A3POTrainer with in-process generation on the same GPU: loglinear (ahead: generation on its own
             CUDA stream while the trainer steps), loglinear-noahead (max_staleness=0: the two take turns), recompute,
             sync (TRL's generation path, HF generate): seconds per version, generator tok/s, idle shares, GPU busy
  emulated   the paper's regime: generation on other GPUs, emulated (benchmarks/emulated_engine.py; no GPU), the
             trainer on this one: sync / recompute / loglinear at the paper's layout scaled down (--engine-rate)
  prox       proximal log-probs, recompute (a forward) vs loglinear (element-wise), 16 / 64 / 256 x 1,024 tokens
  step       optimizer steps of the decoupled loss with each proximal method, generation excluded
  colocate   the colocated vLLM engine (use_vllm=True, vllm_mode='colocate'), where vLLM can be imported
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import emit  # noqa: E402


SHAPE = "qwen2.5-1.5b-shape"
# The emulated engine's rate on the GPU: 64 x 1,024 tokens per version in ~1.9 s, about 0.8 of the trainer's time per
# version there (4 optimizer steps of 16 x 1,152 tokens: ~2.3 s on the H200, 2026-12-04), the proportion of the paper's
# setup 1 (issue 45: ~54 s of training, 35-50 s of generation). The table reports both, so the proportion can be read
# back; at 24,000 tok/s (generation 1.2x the training) the same run was generation-bound (RESULTS.md).
GPU_ENGINE_RATE = 35_000


def tables(cpu: bool, jsonl: str) -> list[tuple[str, int, list[str]]]:
    """(name, time box in seconds, command) per table, in order."""
    py = sys.executable
    if cpu:
        common = ["--steps", "8", "--batch", "4", "--gradient-accumulation-steps", "2", "--steps-per-generation", "4"]
        common += ["--prompt-tokens", "8", "--completion-tokens", "8", "--max-staleness", "2", "--model", "tiny-shape"]
        vllm_python = os.environ.get("A3PO_VLLM_PYTHON", ".venv-vllm/bin/python")
        return [
            (
                "decoders",
                120,
                [py, HERE / "decoders.py", "--device", "cpu", "--model", "tiny", "--batch", "4"]
                + ["--prompt-tokens", "12", "--completion-tokens", "16"],
            ),
            (
                "inprocess",
                240,
                [py, HERE / "methods.py", "--methods", "loglinear", "loglinear-noahead", "recompute"]
                + ["sync", *common],
            ),
            (
                "emulated",
                180,
                [py, HERE / "methods.py", "--backend", "emulated", "--engine-rate", "400"]
                + ["--methods", "sync", "recompute", "loglinear", *common],
            ),
            (
                "prox",
                60,
                [py, HERE / "prox_cost.py", "--device", "cpu", "--models", "tiny", "--shapes", "2x16"]
                + ["4x16", "--prompt-tokens", "8", "--micro-batch", "2", "--repeats", "2"],
            ),
            (
                "step",
                60,
                [py, HERE / "step_cost.py", "--device", "cpu", "--model", "tiny", "--batch", "2"]
                + ["--prompt-tokens", "8", "--completion-tokens", "8", "--micro-batch", "1", "--steps", "2"],
            ),
            (
                "colocate",
                240,
                [vllm_python, HERE / "methods.py", "--methods", "sync", "loglinear"] + ["loglinear-colocate", *common],
            ),
        ]
    common = ["--model", SHAPE, "--gradient-checkpointing", "--max-staleness", "2"]
    return [
        # the compiled decoder first: HF generate's row is the slow one (and the one a cut-off box loses)
        (
            "decoders",
            165,
            [py, HERE / "decoders.py", "--model", SHAPE, "--batch", "64", "--prompt-tokens", "128"]
            + ["--completion-tokens", "512", "--calls", "2", "--decoders", "compiled", "hf-generate"],
        ),
        # 64 completions of 256 tokens per version, 4 optimizer steps of 16 (8 x 2 accumulated), 3 versions
        (
            "inprocess",
            175,
            [py, HERE / "methods.py", "--methods", "loglinear", "loglinear-noahead", "recompute"]
            + ["sync", "--steps", "12", "--batch", "8", "--gradient-accumulation-steps", "2"]
            + ["--steps-per-generation", "8", "--prompt-tokens", "128", "--completion-tokens", "256", *common],
        ),
        # 64 completions of 1,024 tokens per version, 4 optimizer steps of 16, 4 versions
        (
            "emulated",
            90,
            [py, HERE / "methods.py", "--backend", "emulated", "--engine-rate", str(GPU_ENGINE_RATE)]
            + ["--methods", "sync", "recompute", "loglinear", "--steps", "16", "--batch", "16"]
            + ["--steps-per-generation", "4", "--prompt-tokens", "128", "--completion-tokens", "1024", *common],
        ),
        (
            "prox",
            35,
            [py, HERE / "prox_cost.py", "--device", "cuda", "--models", SHAPE, "--shapes", "16x1024"]
            + ["64x1024", "256x1024", "--micro-batch", "16", "--repeats", "3"],
        ),
        (
            "step",
            40,
            [py, HERE / "step_cost.py", "--device", "cuda", "--model", SHAPE, "--batch", "32"]
            + ["--prompt-tokens", "128", "--completion-tokens", "1024", "--micro-batch", "8", "--steps", "2"]
            + ["--gradient-checkpointing"],
        ),
        (
            "colocate",
            100,
            [py, HERE / "methods.py", "--methods", "sync", "loglinear", "loglinear-colocate"]
            + ["--steps", "12", "--batch", "8", "--gradient-accumulation-steps", "2", "--steps-per-generation", "8"]
            + ["--prompt-tokens", "128", "--completion-tokens", "256", *common],
        ),
    ]


def run_table(name: str, seconds: float, command: list, jsonl: str) -> str:
    """Run one table in a process group of its own; stop the group at the end of its box. Returns its status."""
    command = [str(part) for part in command]
    if name in ("inprocess", "emulated", "colocate"):
        command += ["--table", name]
    command += ["--jsonl", jsonl]
    if name == "colocate" and not importable(command[0], "vllm", "trl_a3po"):
        print(f"\n== {name}: skipped (vLLM cannot be imported by {command[0]})", flush=True)
        emit(jsonl, name, status="skipped", python=command[0])
        return "skipped"
    print(f"\n== {name} (time box {seconds:.0f} s): {' '.join(command)}", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, start_new_session=True)
    try:
        code = process.wait(timeout=seconds)
        status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = f"timed out after {seconds:g} s"
    emit(jsonl, name, status=status, seconds=time.perf_counter() - start)
    print(f"== {name}: {status} ({time.perf_counter() - start:.0f} s)", flush=True)
    return status


def importable(python: str, *modules: str) -> bool:
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        return False
    check = subprocess.run([python, "-c", f"import {', '.join(modules)}"], capture_output=True)
    return check.returncode == 0


def ratios(rows: list[dict]) -> list[str]:
    """The ratios the issue's goals read, from whatever rows were measured."""
    by = {}
    for row in rows:
        key = row.get("method") or row.get("decoder") or row.get("shape")
        if key is not None:
            by.setdefault(row["table"], {})[key] = row
    lines = []
    decoders = by.get("decoders", {})
    if {"hf-generate", "compiled"} <= set(decoders):
        fast, slow = decoders["compiled"], decoders["hf-generate"]
        lines.append(
            f"decoders: compiled {fast['tokens_per_s']:.0f} tok/s vs HF generate {slow['tokens_per_s']:.0f} tok/s = "
            f"{fast['tokens_per_s'] / slow['tokens_per_s']:.2f}x; compiled first call {fast['first_call_s']:.1f} s, "
            f"{fast['recompilations']} graph(s) compiled (a new version loaded in place before the last call)"
        )
    for table, paper in (("inprocess", None), ("emulated", "paper (1.5B): sync/A-3PO 1.5x, recompute/A-3PO 1.2x")):
        methods = by.get(table, {})
        if "loglinear" not in methods:
            continue
        base = methods["loglinear"]["version_s"]
        parts = [
            f"{name}/loglinear {methods[name]['version_s'] / base:.2f}x"
            for name in ("sync", "loglinear-noahead", "recompute")
            if name in methods and methods[name]["version_s"] and base
        ]
        if parts:
            lines.append(f"{table}: s/version " + ", ".join(parts) + (f"  [{paper}]" if paper else ""))
    for shape, row in by.get("prox", {}).items():
        lines.append(
            f"prox {shape}: recompute {row['recompute_s']:.3f} s / loglinear {row['loglinear_s']:.6f} s = "
            f"{row['ratio']:.0f}x"
        )
    step = by.get("step", {})
    if {"recompute", "loglinear"} <= set(step):
        lines.append(f"step: recompute/loglinear {step['recompute']['step_s'] / step['loglinear']['step_s']:.3f}x")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on a CPU (every table's code path)")
    parser.add_argument("--out", default="outputs/gpu_check", help="the folder for gpu_check.jsonl when $OUT is unset")
    parser.add_argument("--only", nargs="+", default=None, help="these tables only")
    parser.add_argument(
        "--time-box", nargs="+", default=[], metavar="TABLE=SECONDS", help="another time box for a table"
    )
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = str(out / "gpu_check.jsonl")
    open(jsonl, "w").close()  # this run's rows only
    boxes = {name: float(seconds) for name, seconds in (item.split("=") for item in args.time_box)}
    print(f"rows: {jsonl}", flush=True)
    for name, seconds, command in tables(args.cpu, jsonl):
        if args.only is None or name in args.only:
            run_table(name, boxes.get(name, seconds), command, jsonl)
    rows = [json.loads(line) for line in open(jsonl)]
    print("\n== ratios")
    for line in ratios(rows):
        print(line)


if __name__ == "__main__":
    main()
