"""A small GPT-style model and a token stream with something to learn, for the examples.

``gpt(...)`` is the kind of ``nn.Sequential`` fastpipe pipelines: a token
embedding, pre-LayerNorm transformer blocks (causal attention through
``F.scaled_dot_product_attention``, a GELU MLP, residuals), and a final
LayerNorm with the vocabulary head. ``batch(step, ...)`` gives the same
batch for the same step on every process: each row counts from a random
start by a random stride (mod the vocabulary), so the next token is
predictable and the loss goes down.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(seq, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def gpt(vocab: int = 256, width: int = 128, heads: int = 4, blocks: int = 6, seq: int = 64,
        seed: int = 0) -> nn.Sequential:
    """Embedding, ``blocks`` Blocks, Head: the same weights for the same ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(Embedding(vocab, width, seq), *(Block(width, heads) for _ in range(blocks)),
                         Head(width, vocab))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits (batch, seq, vocab), targets (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch(step: int, rows: int, seq: int = 64, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, next-token targets), both (rows, seq): the same for the same ``step``."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    ids = (start + stride * torch.arange(seq + 1)) % vocab
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
