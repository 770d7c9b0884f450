"""Body of the spawned gloo ranks of test_fuzz's distributed cases: each
rank steps every case twice and saves its losses, its ``.grad`` and x.grad."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.support import rank_results


def run(rank: int, world: int, init: str, cases: list[dict], out_path: str) -> None:
    from fastpipe import Pipe
    from tests.test_fuzz import mixed_case_data, mixed_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    with rank_results(out_path) as results:
        for case in cases:
            os.environ["FASTPIPE_EXACT_MESSAGES"] = "1" if case["transport"] == "exact" else "0"
            os.environ["FASTPIPE_CHAIN"] = case["chains"]
            x, y = mixed_case_data(case)
            with torch.device("meta") if case["meta"] else contextlib.nullcontext():
                model = mixed_model(case["kinds"], case["seed"])
            pipe = Pipe(model, chunks=case["chunks"], schedule=case["schedule"],
                        balance=case["balance"], stages_per_rank=case["v"],
                        checkpoint=case["checkpoint"], fused_wgrad=case["fused"], timeout=60,
                        shm=case["transport"] == "shm", overlap=case["transport"] == "lanes")
            if case["meta"]:  # this rank's stages only: the others stay meta
                pipe.load_state_dict(mixed_model(case["kinds"], case["seed"]).state_dict())
            steps = []
            for _ in range(2):
                loss = pipe.step(x, y, nn.functional.mse_loss)
                steps.append({"loss": loss, "x_grad": None if x.grad is None else x.grad.clone(),
                              "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None}})
            results.append(steps)


if __name__ == "__main__":
    rank, world, init, cases_path, out = sys.argv[1:]
    run(int(rank), int(world), init, torch.load(cases_path, weights_only=False), out)
