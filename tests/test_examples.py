"""The examples run as the README shows them (torchrun, gloo, 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.multiprocess


def _torchrun(args: list[str], tmp) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # --standalone: a rendezvous on this host at a free port.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *args]
    run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.timeout(300)
def test_hf_dp_pp_saves_and_resumes_on_the_same_curve(tmp_path):
    pytest.importorskip("transformers")
    script = str(ROOT / "examples" / "hf_dp_pp.py")
    common = ["--dp", "2", "--steps", "4", "--layers", "2", "--width", "32", "--seq", "16",
              "--checkpoint", str(tmp_path / "ckpt")]
    out = _torchrun([script, *common, "--save-at", "2", "--losses-to", "first.json"], tmp_path)
    assert "saved step 2" in out
    _torchrun([script, *common, "--resume", "--losses-to", "resumed.json"], tmp_path)
    first = json.loads((tmp_path / "first.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert list(first) == ["1", "2", "3", "4"] and list(resumed) == ["3", "4"]
    assert resumed == {k: first[k] for k in ("3", "4")}
