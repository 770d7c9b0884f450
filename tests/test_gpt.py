"""The GPT (tests.models.gpt) through every schedule: the unsplit model's gradients.

The correctness matrix of the workload people pipeline: every schedule in
local mode (two CPU ranks in one process) and in distributed mode (two gloo
ranks), in float64 to rounding, in float32 to a tolerance, and under bf16
autocast against the usual AMP loop. Split schedules run the GPT's Linears,
LayerNorms and Embeddings through deferred weight gradients
(fastpipe.runtime.deferred), the others through autograd.
"""

from __future__ import annotations

import pytest
import torch

from fastpipe import Pipe
from fastpipe.schedules import names
from tests import models
from tests.test_pipe_distributed import _case, _spawn, _verify

SPR = {"interleaved-1f1b": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}
# 4 blocks + embedding + head = 6 layers: 3 per stage on 2, uneven on 4.
BALANCE = {1: [3, 3], 2: [2, 1, 1, 2]}


def _local(schedule: str, dtype, chunks: int = 4, checkpoint: str = "never", amp: bool = False,
           rows: int = 8):
    model = models.gpt(dtype=dtype)
    ids, tg = models.gpt_batch(rows)
    spr = SPR.get(schedule)
    pipe = Pipe(model, chunks=chunks, schedule=schedule, devices=["cpu", "cpu"],
                stages_per_rank=spr, balance=BALANCE[spr or 1], checkpoint=checkpoint)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = pipe.step(ids, tg, models.lm_loss)
    finally:
        pipe.close()
    return model, loss, ids, tg


@pytest.mark.parametrize("schedule", names())
def test_every_schedule_fp64(schedule):
    model, loss, ids, tg = _local(schedule, torch.float64)
    ref = models.gpt(dtype=torch.float64)
    ref_loss, ref_grads = models.reference(ref, ids, tg, models.lm_loss, 4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("schedule,checkpoint", [("1f1b", "never"), ("zb-h2", "never"),
                                                 ("zbv", "except_last"), ("dualpipev", "always")])
def test_fp32_and_checkpointing(schedule, checkpoint):
    model, loss, ids, tg = _local(schedule, torch.float32, chunks=8, checkpoint=checkpoint)
    ref = models.gpt(dtype=torch.float32)
    ref_loss, ref_grads = models.reference(ref, ids, tg, models.lm_loss, 8)
    torch.testing.assert_close(loss, ref_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_bf16_autocast_matches_the_amp_loop(schedule):
    """Forward and loss under bf16 autocast, backward outside it: deferred W
    computes each weight gradient in bf16, as autograd does, and adds it to
    the float32 .grad."""
    model, _, ids, tg = _local(schedule, torch.float32, amp=True)
    ref = models.gpt(dtype=torch.float32)
    for a, b in zip(ids.tensor_split(4), tg.tensor_split(4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.lm_loss(ref(a), b)
        (loss / 4).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_ranks_every_schedule(tmp_path):
    cases = [_case(s, model="gpt", lm=True, balance=BALANCE[SPR.get(s, 1)]) for s in names()]
    cases += [_case(s, model="gpt32", lm=True, chunks=8, balance=BALANCE[SPR.get(s, 1)],
                    tol={"rtol": 1e-4, "atol": 1e-5}) for s in ("1f1b", "zb-h2", "zbv")]
    cases += [_case("zbv", model="gpt", lm=True, balance=BALANCE[2], checkpoint="except_last")]
    _verify(cases, _spawn(2, cases, tmp_path))
