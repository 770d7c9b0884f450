"""The examples run as the README shows them (python or torchrun, gloo on
127.0.0.1), at tiny sizes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.multiprocess


EXAMPLES = ROOT / "examples"
TINY = ["--steps", "3", "--batch", "8", "--width", "32"]


def _run(cmd: list[str], tmp) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _torchrun(args: list[str], tmp, processes: int = 4) -> str:
    # --standalone: a rendezvous on this host at a free port.
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(processes), *args], tmp)


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step +\d+ +loss (\S+)", out, re.M)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_train_local_trains(schedule, tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "train_local.py"), *TINY, "--blocks", "2",
                "--chunks", "4", "--schedule", schedule], tmp_path)
    losses = _losses(out)
    assert len(losses) == 2 and losses[-1] < losses[0], out  # steps 1 and 3


@pytest.mark.timeout(120)
def test_train_torchrun_matches_the_local_run(tmp_path):
    """Two processes, the same model, data and schedule as train_local: the same losses."""
    args = [*TINY, "--blocks", "2", "--chunks", "4"]
    local = _run([sys.executable, str(EXAMPLES / "train_local.py"), *args], tmp_path)
    ranks = _torchrun([str(EXAMPLES / "train_torchrun.py"), *args], tmp_path, processes=2)
    assert _losses(ranks) == pytest.approx(_losses(local), rel=1e-4)


@pytest.mark.timeout(120)
def test_hf_causal_lm_trains(tmp_path):
    pytest.importorskip("transformers")
    out = _run([sys.executable, str(EXAMPLES / "hf_causal_lm.py"), *TINY, "--model", "llama",
                "--layers", "2", "--seq", "16", "--schedule", "zbv"], tmp_path)
    assert len(_losses(out)) == 2, out


@pytest.mark.timeout(120)
def test_plan_then_train_uses_the_plan(tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "plan_then_train.py"), *TINY, "--blocks", "2"], tmp_path)
    assert re.search(r"^chosen: \S+, \d+ chunks, balance \[", out, re.M), out
    assert len(_losses(out)) == 2, out


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
