"""The GPU check's scripts run where only torch and transformers are installed (the device machine has no TRL,
datasets or math-verify), and print their ratio tables."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Blocks the packages the device lacks: any import of them fails, as it would there.
WITHOUT_TRL = "import runpy, sys; sys.modules.update(trl=None, datasets=None, math_verify=None, peft=None); " \
              "script = sys.argv[1]; sys.argv = sys.argv[1:]; runpy.run_path(script, run_name='__main__')"


def run_without_trl(*argv):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRL, *argv], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_prox_cost_runs_without_trl_and_prints_the_ratio():
    out = run_without_trl("benchmarks/prox_cost.py", "--models", "tiny", "--shapes", "2x16", "--prompt-tokens", "8",
                          "--micro-batch", "2", "--repeats", "2", "--device", "cpu")
    row = [line for line in out.splitlines() if line.startswith("tiny")]
    assert len(row) == 1 and row[0].rstrip().endswith("x"), out
    ratio = float(row[0].split()[-1].rstrip("x").replace(",", ""))
    assert ratio > 1.0  # a forward pass costs more than an element-wise interpolation, even on a tiny model


def test_step_cost_runs_without_trl():
    out = run_without_trl("benchmarks/step_cost.py", "--model", "tiny", "--batch", "2", "--prompt-tokens", "8",
                          "--completion-tokens", "8", "--micro-batch", "1", "--steps", "2", "--device", "cpu")
    assert "recompute" in out and "loglinear" in out, out
