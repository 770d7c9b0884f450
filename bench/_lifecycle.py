"""A Pipe's life on a device: rebuilt over one model, and stepped for long (gpu_check's rebuild, soak).

``rebuild``: Pipes built, stepped and dropped over the same model, one after
another (1f1b, zbv, gpipe; a step that fails, then a new Pipe; an optimizer
step between), each step's gradients against the unsplit model's. On one
GPU this crashed once the first Pipe's CUDA streams were destroyed while
torch still referred to them (``fastpipe/runtime/streams.py``). A GPT of
``tests.models`` runs it, and, where ``transformers`` is importable, a
Hugging Face GPT-2 (a tiny config, tied embeddings, no download) laid out
by ``fastpipe.hf.causal_lm``, against the HF model's own forward.

``soak``: 200 AdamW steps under bf16 autocast with 1f1b and with zbv: the
loss goes down; live and reserved GPU memory and the host heap stop
growing once warmed up.

Both take the device check's ``check(name, ok, detail)`` and
``figure(name, value, unit, note)``. On ``dev="cpu"`` (the rehearsal) the
Pipes are forced onto the copy path (``FASTPIPE_COPY_LANES=1``, host lanes),
the path GPU ranks take, at tiny sizes.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable

import torch
from torch import nn

from bench._runner import switched
from tests.models import gpt, gpt_batch, lm_loss
from tests.support import FailsOnce, heap_in_use

Check = Callable[..., None]
# (schedule, whether a Pipe whose step fails comes first): the rebuild sequence.
REBUILDS = (("1f1b", False), ("zbv", False), ("gpipe", True), ("1f1b", False))


def _pipe(model: nn.Sequential, schedule: str, dev: str, chunks: int):
    from fastpipe import Pipe

    devices = ["cuda:0", "cuda:0"] if dev == "cuda" else ["cpu", "cpu"]
    with switched(copy_lanes="1"):  # on a GPU already so; on the CPU the same path with host lanes
        return Pipe(model, chunks=chunks, schedule=schedule, devices=devices, timeout=60,
                    stages_per_rank=2 if schedule == "zbv" else None)


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _reference(forward, params: dict, x, y, chunks: int) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of the unsplit model: the mean of ``lm_loss`` over microbatches."""
    for p in params.values():
        p.grad = None
    loss = sum(lm_loss(forward(a), b) for a, b in zip(x.tensor_split(chunks), y.tensor_split(chunks))) / chunks
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in params.items()}


def _rebuild_sequence(label: str, seq: nn.Sequential, params: dict, forward, ref_params: dict,
                      x, y, chunks: int, dev: str, tol: float, check: Check) -> None:
    """REBUILDS over ``seq`` (whose parameters are ``params``, by name), each
    step against ``forward`` (the unsplit reference, parameters ``ref_params``)."""
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)  # linear in the gradients:
    ref_opt = torch.optim.SGD(ref_params.values(), lr=0.1, momentum=0.9)  # Adam scales up noise
    for i, (schedule, fail_first) in enumerate(REBUILDS):
        if fail_first:
            pipe = _pipe(seq, schedule, dev, chunks)
            try:
                pipe.step(x, y, FailsOnce(lm_loss, at=3))
                failed = False
            except ValueError:
                failed = True
            check(f"{label}: {schedule}'s step failed as its loss raised", failed)
            pipe.close()
            del pipe
            gc.collect()
        opt.zero_grad(set_to_none=True)
        pipe = _pipe(seq, schedule, dev, chunks)
        loss = pipe.step(x, y, lm_loss)
        want, grads = _reference(forward, ref_params, x, y, chunks)
        _sync(dev)
        scale = max(g.abs().max().item() for g in grads.values())
        diff = max([abs(loss.item() - want.item())]
                   + [(params[n].grad - g).abs().max().item() for n, g in grads.items()])
        check(f"{label}: Pipe {i + 1} ({schedule}{', after a failed one' if fail_first else ''}) "
              "reproduces the unsplit model's loss and gradients", diff <= tol * scale,
              f"max abs diff {diff:.1e}, largest gradient {scale:.1e}")
        opt.step()
        ref_opt.step()
        if i % 2 == 0:
            pipe.close()
        del pipe  # every other one dropped without close(): collected, it gives its streams back
        gc.collect()
    _sync(dev)
    diff = max((params[n] - q).abs().max().item() for n, q in ref_params.items())
    check(f"{label}: parameters after {len(REBUILDS)} optimizer steps equal the unsplit model's",
          diff <= tol, f"max abs diff {diff:.1e}")


def _gpt_rebuild(dev: str, small: bool, check: Check) -> None:
    sizes = (dict(vocab=32, d=16, heads=2, blocks=4, seq=8) if small
             else dict(vocab=256, d=128, heads=4, blocks=4, seq=64))
    model = gpt(**sizes, dtype=torch.float64).to(dev)
    ref = copy.deepcopy(model)
    x, y = (t.to(dev) for t in gpt_batch(8 if small else 16, vocab=sizes["vocab"], seq=sizes["seq"]))
    _rebuild_sequence("gpt fp64", model, dict(model.named_parameters()), ref,
                      dict(ref.named_parameters()), x, y, 4, dev, 1e-10, check)


def _hf_rebuild(dev: str, small: bool, check: Check) -> None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        from fastpipe.hf import causal_lm
    except ImportError:
        print("  (transformers not importable: the Hugging Face GPT-2 is skipped)")
        return
    vocab, seq, d, layers = (32, 8, 16, 2) if small else (256, 64, 128, 4)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=layers, n_head=4 if d >= 64 else 2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(config).to(dev)
    ref = copy.deepcopy(hf)
    check("hf gpt2: lm_head's weight is wte's (tied)", hf.lm_head.weight is hf.transformer.wte.weight)
    x, y = (t.to(dev) for t in gpt_batch(8 if small else 16, vocab=vocab, seq=seq))
    _rebuild_sequence("hf gpt2 fp32", causal_lm(hf), dict(hf.named_parameters()),
                      lambda ids: ref(input_ids=ids).logits, dict(ref.named_parameters()),
                      x, y, 4, dev, 1e-4, check)


def rebuild(dev: str, small: bool, check: Check, figure) -> None:
    """The rebuild sequence on a GPT (fp64) and a Hugging Face GPT-2 (fp32)."""
    _gpt_rebuild(dev, small, check)
    _hf_rebuild(dev, small, check)
    gc.collect()
    _sync(dev)
    if dev == "cuda":
        from fastpipe.runtime.streams import cuda_streams

        pool = cuda_streams()
        # Everything the Pipes made is freed by now: the allocator has recorded
        # events on the lanes' streams for blocks used there (insert_events).
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        streams = {role: len(pool.made(0, role, prio)) for role, prio in
                   (("compute", 0), ("copy", _copy_priority()))}
        check("rebuilt Pipes reuse the process's streams (two ranks: at most 2 per role)",
              max(streams.values()) <= 2 and pool.leased() == 0,
              f"made {streams}, still leased {pool.leased()}")
        figure("rebuild: GPU memory still allocated after the sequence", torch.cuda.memory_allocated() / 2**20,
               " MiB", "every Pipe and model dropped, after empty_cache")


def _copy_priority() -> int:
    from fastpipe._ext import native

    return native().cuda_priority_range(0)[1]


# --- soak -------------------------------------------------------------------------


def _bigram_batches(n: int, batch: int, seq: int, vocab: int, dev: str) -> list[tuple]:
    """``n`` batches of a task a GPT learns fast: each next token is a fixed
    permutation of the current one, from random starting tokens."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(n):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            ids[:, t + 1] = perm[ids[:, t]]
        out.append((ids[:, :-1].contiguous().to(dev), ids[:, 1:].contiguous().to(dev)))
    return out


def _marks(dev: str) -> dict:
    _sync(dev)
    return {"allocated": torch.cuda.memory_allocated() if dev == "cuda" else None,
            "reserved": torch.cuda.memory_reserved() if dev == "cuda" else None,
            "heap": heap_in_use()}


def _soak_one(schedule: str, dev: str, small: bool, check: Check, figure) -> None:
    steps, warm = (12, 4) if small else (200, 20)
    sizes = (dict(vocab=32, d=16, heads=2, blocks=4, seq=8) if small
             else dict(vocab=2048, d=512, heads=8, blocks=4, seq=256))
    model = gpt(**sizes, dtype=torch.float32).to(dev)
    batches = _bigram_batches(8, 8 if small else 16, sizes["seq"], sizes["vocab"], dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 if small else 1e-3)
    pipe = _pipe(model, schedule, dev, 4)
    losses, marks = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        if step == warm:
            t0 = time.perf_counter()
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = pipe.step(x, y, lm_loss)
        opt.step()
        losses.append(loss.item())  # syncs
        if step >= warm:
            marks.append(_marks(dev))
    seconds = time.perf_counter() - t0
    pipe.close()
    label = f"soak {schedule}"
    figure(f"{label}: step time after warm-up", seconds / (steps - warm) * 1e3, " ms",
           f"{steps} AdamW steps, bf16 autocast, 2 ranks")
    k = 3 if small else 10
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    check(f"{label}: the loss goes down", last < (0.95 if small else 0.5) * first,
          f"mean of the first {k} steps {first:.3f}, of the last {k} {last:.3f}")
    _flat(label, marks, small, check, figure)


def _flat(label: str, marks: list[dict], small: bool, check: Check, figure) -> None:
    """After warm-up nothing grows in the second half of the steps: a leak
    grows step after step, one-off caching settles in the first half. The
    GPU's peaks may move a little with how two ranks' threads interleave
    (2 % of the first half's, at least 4 MiB); a leak of one microbatch's
    activations a step would pass that many times over in 100 steps."""
    half = len(marks) // 2
    first, second = marks[:half], marks[half:]
    heap = [("heap", (256 if small else 1024) * 2**10)] if marks[0]["heap"] is not None else []
    gpu = [(what, max(4 * 2**20, int(0.02 * max(m[what] for m in first))))
           for what in ("allocated", "reserved")] if marks[0]["reserved"] is not None else []
    for what, slack in gpu + heap:
        grown = max(m[what] for m in second) - max(m[what] for m in first)
        figure(f"{label}: {what} growth over the second half", grown / 2**20, " MiB",
               f"{len(second)} steps; at the end {marks[-1][what] / 2**20:.1f} MiB")
        check(f"{label}: {what} memory flat after warm-up", grown <= slack,
              f"{grown / 2**10:.0f} KiB more in the second half (allowed {slack // 2**10} KiB)")


def soak(dev: str, small: bool, check: Check, figure) -> None:
    """200 steps with 1f1b and with zbv (12 on the CPU rehearsal)."""
    for schedule in ("1f1b", "zbv"):
        _soak_one(schedule, dev, small, check, figure)
        gc.collect()
