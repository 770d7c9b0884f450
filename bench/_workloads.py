"""The models the pipelining benchmarks run: a GPT first, then the MLPs.

A workload is a model family and a size: ``gpt`` is the transformer people
pipeline (``tests.models.gpt``: token and position embedding, pre-LN blocks
with causal attention through ``scaled_dot_product_attention`` and a GELU
MLP, final LayerNorm and vocabulary head, next-token cross-entropy); ``mlp``
is a stack of Linear/GELU/Linear blocks (MSE); ``hf-gpt2`` and ``hf-llama``
are Hugging Face's own models (``GPT2LMHeadModel``: tied embeddings, its
``Conv1D`` projections; ``LlamaForCausalLM``: RMSNorm, rotary positions,
grouped-query attention, SwiGLU MLP; built from a config) cut by
``fastpipe.hf.causal_lm``, asked for by name only (they need
``transformers``). Each comes in a compute-bound size (arithmetic
dominates) and an overhead-bound one
(per-op framework cost dominates). Every library gets the same layers per
stage (``Workload.balance``), so ratios compare schedules and runtimes, not
splits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tests.models import gpt, gpt_batch, lm_loss

MODELS = ["gpt", "mlp"]  # what --model both runs; the Hugging Face models by name
HF_MODELS = ["hf-gpt2", "hf-llama"]


@dataclass(frozen=True)
class Workload:
    model: str  # "gpt" or "mlp"
    size: str  # "compute" or "overhead"
    sizes: dict  # the builder's arguments
    batch: int
    chunks: int
    blocks_set: bool = False  # blocks set by --blocks: the name says how many
    # Splits set by --balance, (schedule name, layers per stage) pairs: run
    # in place of the profiled ones (in the parent, which hands them on).
    splits: tuple = ()

    @property
    def name(self) -> str:
        base = f"{self.model}-{self.size}"
        return f"{base}@{self.sizes['blocks']}" if self.blocks_set else base

    def build(self) -> nn.Sequential:
        """The model, the same weights every call (seeded)."""
        if self.model == "gpt":
            return gpt(dtype=torch.float32, seed=0, **self.sizes)
        if self.model == "hf-gpt2":
            return _hf_gpt2(**self.sizes)
        if self.model == "hf-llama":
            return _hf_llama(**self.sizes)
        torch.manual_seed(0)
        width, blocks = self.sizes["width"], self.sizes["blocks"]
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                             nn.Linear(4 * width, width)) for _ in range(blocks)])

    def data(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's input and target."""
        if self.model == "gpt":
            return gpt_batch(self.batch, self.sizes["vocab"], self.sizes["seq"], seed=seed)
        if self.model in HF_MODELS:  # labels are the ids: the loss shifts them
            ids = torch.randint(self.sizes["vocab"], (self.batch, self.sizes["seq"]),
                                generator=torch.Generator().manual_seed(seed))
            return ids, ids
        g = torch.Generator().manual_seed(seed)
        width = self.sizes["width"]
        return (torch.randn(self.batch, width, generator=g),
                torch.randn(self.batch, width, generator=g))

    @property
    def loss_fn(self) -> Callable:
        if self.model in HF_MODELS:
            from fastpipe.hf import lm_loss as hf_loss

            return hf_loss
        return lm_loss if self.model == "gpt" else nn.functional.mse_loss

    def describe(self) -> str:
        if self.model in ("gpt", *HF_MODELS):
            s = self.sizes
            title = {"gpt": "GPT", "hf-gpt2": "HF GPT-2", "hf-llama": "HF Llama"}[self.model]
            return (f"{title} {s['blocks']} blocks d={s['d']} heads={s['heads']} seq={s['seq']} "
                    f"vocab={s['vocab']}, batch {self.batch}, {self.chunks} microbatches")
        return (f"{self.sizes['blocks']} MLP blocks d={self.sizes['width']}, batch {self.batch}, "
                f"{self.chunks} microbatches")

    def balance(self, schedule) -> list[int]:
        """Layers per stage for ``schedule`` (a ``fastpipe.schedules.Schedule``):
        the measured layer times split as ``Pipe(balance="auto")`` splits
        them (``fastpipe._plan.balance_for``: even stages, or where a rank
        runs several, the split whose simulated step is shortest). Even layer
        counts would put a V's embedding and head (first and last stage) on
        one rank beside two blocks and leave the other rank four. Made in
        the parent process and handed to every rank and library, so all
        run one split."""
        from fastpipe._plan import balance_for

        given = dict(self.splits).get(schedule.name)
        return list(given) if given is not None else balance_for(_profile(self.name), schedule)

    def sequential_step(self) -> Callable[[], None]:
        """fwd+bwd of the unsplit model over the same microbatches."""
        model, (x, y), loss_fn = self.build(), self.data(), self.loss_fn

        def step():
            for a, b in zip(x.tensor_split(self.chunks), y.tensor_split(self.chunks)):
                (loss_fn(model(a), b) / self.chunks).backward()

        return step


WORKLOADS = {
    w.name: w for w in (
        # GPT: 6 blocks + embedding + head = 8 layers (2 per stage on 4 stages).
        Workload("gpt", "compute", dict(vocab=2048, d=256, heads=4, blocks=6, seq=64), 8, 8),
        Workload("gpt", "overhead", dict(vocab=256, d=64, heads=2, blocks=6, seq=16), 16, 8),
        Workload("hf-gpt2", "compute", dict(vocab=2048, d=256, heads=4, blocks=6, seq=64), 8, 8),
        Workload("hf-gpt2", "overhead", dict(vocab=256, d=64, heads=2, blocks=6, seq=16), 16, 8),
        Workload("hf-llama", "compute", dict(vocab=2048, d=256, heads=4, blocks=6, seq=64), 8, 8),
        Workload("hf-llama", "overhead", dict(vocab=256, d=64, heads=2, blocks=6, seq=16), 16, 8),
        Workload("mlp", "compute", dict(width=512, blocks=8), 64, 8),
        Workload("mlp", "overhead", dict(width=128, blocks=8), 64, 16),
    )
}


def _hf_gpt2(vocab: int, d: int, heads: int, blocks: int, seq: int) -> nn.Sequential:
    """GPT2LMHeadModel from a config (nothing downloaded; no dropout, tied
    embeddings), float32, as ``causal_lm``'s Sequential: blocks + 3 layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastpipe.hf import causal_lm

    torch.manual_seed(0)
    config = GPT2Config(n_layer=blocks, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=seq,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return causal_lm(GPT2LMHeadModel(config).float())


def _hf_llama(vocab: int, d: int, heads: int, blocks: int, seq: int) -> nn.Sequential:
    """LlamaForCausalLM from a config (half as many key/value heads, an MLP
    of 8/3 d rounded to 8, tied embeddings), float32, as ``causal_lm``'s Sequential."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastpipe.hf import causal_lm

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=blocks, hidden_size=d, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), intermediate_size=(8 * d // 3 + 7) // 8 * 8,
                         vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return causal_lm(LlamaForCausalLM(config).float())


def workload(name: str) -> Workload:
    """The workload a ``Workload.name`` names (``gpt-overhead``, or
    ``gpt-overhead@14``: the same with 14 blocks), in any process: ranks
    are given names, not workloads."""
    base, _, blocks = name.partition("@")
    w = WORKLOADS[base]
    if not blocks:
        return w
    if int(blocks) < 1:
        raise ValueError(f"a workload needs at least one block, got {blocks} ({name!r})")
    return dataclasses.replace(w, sizes={**w.sizes, "blocks": int(blocks)}, blocks_set=True)


@functools.cache
def _profile(name: str):
    """Each layer's measured forward, backward, I and W at one microbatch, one
    thread, the loss with the last layer (as ``Pipe(balance="auto")`` profiles
    a step given its target)."""
    from fastpipe.balance import profile

    w = workload(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, y = w.data()
        return profile(w.build(), x, "cpu", w.chunks, loss_fn=w.loss_fn, target=y)
    finally:
        torch.set_num_threads(threads)


def selected(args) -> list[Workload]:
    """The workloads ``--model`` and ``--workload`` ask for, GPT first;
    ``--blocks N`` (where the command has it) gives the transformers N
    blocks instead of their own count (the MLPs keep theirs); ``--balance
    SCHEDULE=N,...`` sets that schedule's split on every one of them."""
    models = MODELS if args.model == "both" else [args.model]  # HF_MODELS only by name
    sizes = ["compute", "overhead"] if args.workload == "both" else [args.workload]
    blocks = getattr(args, "blocks", None)
    chosen = [workload(f"{m}-{s}@{blocks}" if blocks is not None and m != "mlp" else f"{m}-{s}")
              for m in models for s in sizes]
    splits = tuple(getattr(args, "balance", None) or ())  # --balance
    return [dataclasses.replace(w, splits=splits) for w in chosen] if splits else chosen
