"""The device check script rehearsed on the CPU, so it is known to run before a GPU is at hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_rehearsal_runs_every_section(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["sections_failed"] == []
    assert result["checks"] and all(result["checks"].values())
    # Every section reported figures.
    names = " ".join(result["figures"])
    for word in ("copy bandwidth", "pipeline / sequential", "step time per action", "recompute",
                 "soak zbv: step time"):
        assert word in names
    # The rebuild sequence ran to its end (its last check compares the parameters).
    assert any(k.startswith("gpt fp64: parameters after") for k in result["checks"])


def test_gpu_check_refuses_unknown_sections():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--sections", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown sections" in proc.stderr
