"""Data × pipeline parallelism and checkpoints: 4 spawned gloo ranks as a
("dp", "pp") = (2, 2) DeviceMesh reproduce the sequential model over the
whole global batch, and what they save with torch.distributed.checkpoint
loads into the plain model and into a pipeline of another shape."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import fastpipe
from fastpipe.schedules import build
from tests import models
from tests.support import spawn_ranks

pytestmark = pytest.mark.multiprocess

CHUNKS = 2  # microbatches per replica: 2 replicas x 2 = 4 microbatches of the global batch


def _batches(model: str, steps: int, rows: int = 8) -> list[tuple]:
    if model == "gpt":
        return [models.gpt_batch(rows, seed=s) for s in range(steps)]
    torch.manual_seed(3)
    if model == "mlp":
        return [(torch.randn(rows, 5, dtype=torch.float64), torch.randn(rows, 3, dtype=torch.float64))
                for _ in range(steps)]
    return [(torch.randint(0, 11, (rows, 4)), torch.randn(rows, 4, 3, dtype=torch.float64))
            for _ in range(steps)]


def _loss_fn(case):
    return models.lm_loss if case.get("lm") else nn.functional.mse_loss


def _reference(case):
    """The unsplit model's losses and grads: the mean over the global batch's
    microbatches (each replica's shard, split into its microbatches)."""
    model = getattr(models, case["model"])()
    losses = []
    for x, y in case["batches"]:
        xs, ys = ([p for half in torch.tensor_split(t, 2) for p in torch.tensor_split(half, CHUNKS)]
                  for t in (x, y))
        loss = sum(_loss_fn(case)(model(a), b) for a, b in zip(xs, ys)) / len(xs)
        loss.backward()
        losses.append(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"]) if case.get("clip") else None
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, norm


@pytest.mark.timeout(300)
def test_dp_times_pp_reproduces_the_global_batch(tmp_path):
    cases = [
        {"kind": "grads", "model": "gpt", "schedule": s, "chunks": CHUNKS, "lm": True,
         "batches": _batches("gpt", 2)}
        for s in ("1f1b", "zbv")
    ]
    # Tied across the pipeline ranks (summed there), then averaged across replicas; clipped globally.
    cases.append({"kind": "grads", "model": "tied_embedding_model", "schedule": "1f1b",
                  "chunks": CHUNKS, "batches": _batches("tied", 2), "clip": 0.05})
    cases.append({"kind": "grads", "model": "gpt", "schedule": "zbv", "chunks": CHUNKS, "lm": True,
                  "batches": _batches("gpt", 1), "shm": True, "fused": True})
    # What no gradient reaches keeps .grad None on every replica (nothing to average).
    cases += [{"kind": "grads", "model": m, "schedule": s, "chunks": CHUNKS, "balance": b,
               "batches": _batches("mlp", 2)}
              for m, s, b in (("gapped_model", "zbv", [1, 1, 2, 2]), ("detached_model", "1f1b", [2, 4]))]
    # Reordered for the second step's measured costs: every replica takes the first one's.
    cases.append({"kind": "grads", "model": "gpt", "schedule": "zb-h1", "chunks": CHUNKS, "lm": True,
                  "batches": _batches("gpt", 4), "forced_order": True})
    # Replicas (or tied copies) that start apart are refused on every rank.
    cases.append({"kind": "refused", "model": "gpt", "schedule": "1f1b", "chunks": CHUNKS, "lm": True,
                  "batches": _batches("gpt", 1), "apart": "dp"})
    cases.append({"kind": "refused", "model": "tied_embedding_model", "schedule": "1f1b", "chunks": 4,
                  "batches": _batches("tied", 1), "apart": "tie"})
    # A step that fails on one replica fails on all (the others do not wait for its gradients).
    cases.append({"kind": "fails", "model": "gpt", "schedule": "zbv", "chunks": CHUNKS, "lm": True,
                  "batches": _batches("gpt", 1)})
    results = spawn_ranks("tests._mesh_worker", 4, cases, tmp_path)
    for i, case in enumerate(cases):
        if case["kind"] == "fails":
            healthy = [r[i]["step"] for r in results[:2]]
            assert all(kind == "RuntimeError" and "failed on 1 of the 2 data-parallel replicas" in why
                       for kind, why in healthy), healthy
            assert sorted(r[i]["step"][0] for r in results[2:]) == ["PeerError", "ValueError"]
            for rank_results in results:
                assert "an earlier step of this Pipe failed" in rank_results[i]["next step"][1]
            continue
        if case["kind"] == "refused":
            who = {"dp": "data-parallel replicas", "tie": "pipeline ranks sharing a parameter"}
            for rank_results in results:
                assert f"{who[case['apart']]} start from different values" in rank_results[i]["refused"]
            continue
        if case.get("forced_order"):  # the same seconds (replica 0's) on all four ranks, once
            seen = [r[i]["measured"] for r in results]
            assert len(seen[0]) == 1 and all(x == seen[0] for x in seen), seen
            forced = build("zb-h1", 2, CHUNKS, costs={"F": 1.0, "I": 1.0, "W": 0.25}).actions
            assert all(r[i]["order"] == forced for r in results)
        losses, ref_grads, norm = _reference(case)
        for rank_results in results:
            got = rank_results[i]
            torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(losses))
            if norm is not None:
                torch.testing.assert_close(got["norm"], norm)
        for replica in (results[:2], results[2:]):  # ranks (0, 1) and (2, 3): one pipeline each
            grads = {}
            for rank_results in replica:
                grads.update(rank_results[i]["grads"])
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], msg=f"{case['schedule']}: {name}")


@pytest.mark.timeout(300)
def test_checkpoint_resumes_in_another_layout(tmp_path):
    """dp=2 x pp=2 zbv trains, saves model and AdamW state with DCP, trains on;
    a model from another seed in one pipeline of 4 ranks (1f1b) loads the
    checkpoint and trains the same steps on the same curve; the plain model
    loads the same checkpoint in this process."""
    path = str(tmp_path / "ckpt")
    case = {"kind": "resume", "model": "tied_embedding_model", "schedule": "zbv",
            "resume_schedule": "1f1b", "chunks": CHUNKS, "batches": _batches("tied", 5),
            "saved_at": 3, "path": path}
    results = spawn_ranks("tests._mesh_worker", 4, [case], tmp_path)
    got = [r[0] for r in results]
    for rank_results in got[1:]:
        assert rank_results["after"] == got[0]["after"]  # one loss on every rank
        assert rank_results["resumed"] == got[0]["resumed"]
    torch.testing.assert_close(torch.tensor(got[0]["resumed"]), torch.tensor(got[0]["after"]))
    assert got[0]["after"][-1] < got[0]["before"][0]  # it trains
    saved = {}
    for rank_results in got:
        for name, t in rank_results["saved"].items():
            if name in saved:  # a tied weight, or a replica's copy: equal everywhere
                torch.testing.assert_close(t, saved[name], rtol=0, atol=0)
            saved[name] = t
        for name, t in rank_results["loaded"].items():
            torch.testing.assert_close(t, saved[name], rtol=0, atol=0)
    # The tied embedding and head weight is stored once, under its first name.
    plain = models.tied_embedding_model(seed=2)
    keys = fastpipe.state_dict(plain)
    assert saved.keys() == keys.keys() and "4.weight" not in keys
    dcp.load({"model": keys}, checkpoint_id=path)  # one process, no process group
    for name, t in plain.state_dict().items():
        torch.testing.assert_close(t, saved["0.weight" if name == "4.weight" else name], rtol=0, atol=0)
