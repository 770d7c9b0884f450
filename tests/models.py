"""Tiny models shared by the executor tests, and their sequential reference."""

from __future__ import annotations

import torch
from torch import nn


class TupleOut(nn.Module):
    """Returns (h, mask, h*2): a float pair and a bool tensor cross the boundary."""

    def forward(self, x):
        return x, x > 0, x * 2


class TupleIn(nn.Module):
    """Consumes TupleOut's tuple as one argument, like nn.Sequential passes it."""

    def forward(self, value):
        h, mask, h2 = value
        return torch.where(mask, h, h2 * 0.5) + h2


def mlp(depth: int = 6, width: int = 8, dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(5, width)]
    for i in range(depth - 2):
        layers.append(nn.Tanh() if i % 2 else nn.Linear(width, width))
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers).to(dtype)


def tuple_model(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 8), TupleOut(), TupleIn(), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 3)
    ).to(dtype)


class Fork(nn.Module):
    """x -> (x, side(x)): a second float output that no later layer reads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.side = nn.Linear(width, width)

    def forward(self, x):
        return x, self.side(x)


class First(nn.Module):
    def forward(self, value):
        return value[0]


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


def gapped_model(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """A boundary after Fork (balance [2, 4]; [1, 1, 2, 2] for a V) carries
    a member no gradient reaches: ``side`` keeps ``.grad`` None."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), Fork(8), First(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).to(dtype)


def detached_model(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """A stage that starts with Detach (balance [2, 4]; [1, 1, 2, 2] for a V)
    sends no gradient back: every layer before it keeps ``.grad`` None."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), Detach(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).to(dtype)


def embedding_model(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """Integer input first: token ids → embedding → per-token MLP."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(11, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3)
    ).to(dtype)


def tied_mlp(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """An MLP whose layers 1 and 6 are one module: balanced [2, 2, 2, 2] the
    tie joins stages 0 and 3 (one rank under V placement), [4, 4] stages 0 and 1."""
    torch.manual_seed(seed)
    shared = nn.Linear(8, 8)
    return nn.Sequential(nn.Linear(5, 8), shared, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), shared, nn.Linear(8, 3)).to(dtype)


def tied_embedding_model(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """Token ids → embedding → MLP → projection onto the vocabulary with the
    embedding's own weight (a language model's tied embedding) → 3 outputs."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(11, 8)
    head = nn.Linear(8, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), head,
                         nn.Linear(11, 3)).to(dtype)


def loss_of(case: dict):
    """The loss a distributed test case trains with: ``case["loss"]`` names a
    function here; else ``lm_loss`` where ``case["lm"]``, else MSE."""
    if "loss" in case:
        return globals()[case["loss"]]
    return lm_loss if case.get("lm") else nn.functional.mse_loss


def reference(model: nn.Sequential, x, y, loss_fn, chunks: int):
    """Loss and grads of the unsplit model: mean over microbatches of loss_fn.
    ``x`` is a tensor or a tuple of tensors, split along dim 0 as a Pipe splits it."""
    xs = (torch.tensor_split(x, chunks) if isinstance(x, torch.Tensor)
          else list(zip(*(torch.tensor_split(t, chunks) for t in x))))
    ys = torch.tensor_split(y, chunks)
    loss = sum(loss_fn(model(a), b) for a, b in zip(xs, ys)) / chunks
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


class _Fp32Matmul(torch.autograd.Function):
    """``x @ w`` in float32 both ways, whatever autocast says in forward;
    its backward has no ``custom_bwd``, so it runs under whatever autocast
    region is active when backward runs: a backward under autocast gives it
    bf16 gradients."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with torch.autocast("cpu", enabled=False):
            return x.float() @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g.float() @ w.t()).to(x.dtype), x.float().t() @ g.float()


class Fp32Matmul(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        return _Fp32Matmul.apply(x, self.weight)


def amp_model(seed: int = 0) -> nn.Sequential:
    """float32 layers for autocast, one of them computing its gradient in float32."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), Fp32Matmul(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def amp_reference(model: nn.Sequential, x, y, chunks: int) -> list[torch.dtype]:
    """The usual AMP loop over microbatches: forward and loss under CPU bf16
    autocast, ``(loss / chunks).backward()`` outside it. Returns the output
    dtype of each microbatch."""
    dtypes = []
    for a, b in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(a)
            loss = nn.functional.mse_loss(out, b)
        (loss / chunks).backward()
        dtypes.append(out.dtype)
    return dtypes


def mlp_deep(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """Enough layers for 4 ranks × 2 stages."""
    return mlp(depth=10, dtype=dtype, seed=seed)


class FiveOut(nn.Module):
    """Five tensors (float, float, bool, float, int) and three plain values cross the boundary."""

    def forward(self, x):
        return (x, x * 2, x > 0, x.sum(-1, keepdim=True), (x > 0).sum(-1), 3, "scale", None)


class FiveIn(nn.Module):
    def forward(self, value):
        h, h2, mask, s, idx, k, name, nothing = value
        if (k, name, nothing) != (3, "scale", None):
            raise AssertionError(f"plain values did not survive: {(k, name, nothing)!r}")
        return torch.where(mask, h, h2) + s * k + idx[:, None].to(h.dtype)


def five_model(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """Use balance=[2, 3]: the boundary carries FiveOut's value."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), FiveOut(), FiveIn(), nn.Linear(8, 8), nn.Linear(8, 3)).to(dtype)


# --- a GPT: the workload people pipeline -------------------------------------
#
# Pre-LN decoder blocks as separate layers of one nn.Sequential, the shape the
# benchmarks and the correctness matrix use: token + position embedding,
# blocks (LayerNorm, causal attention through scaled_dot_product_attention,
# GELU MLP, residual adds), then LayerNorm and the vocabulary head.


class Embed(nn.Module):
    """Token ids (batch, seq) → token + learned position embeddings (batch, seq, d)."""

    def __init__(self, vocab: int, d: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(seq, d)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(pos)


class Block(nn.Module):
    """x + attention(LN(x)), then x + MLP(LN(x)); causal, ``heads`` heads."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.act, self.down = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, d / heads)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(self.act(self.up(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: (batch, seq, d) → logits."""

    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def gpt(vocab: int = 32, d: int = 16, heads: int = 2, blocks: int = 4, seq: int = 8,
        dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """Embed, ``blocks`` Blocks, Head: ``blocks + 2`` layers to balance."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, d, seq), *[Block(d, heads) for _ in range(blocks)],
                         Head(d, vocab)).to(dtype)


def gpt32(seed: int = 0) -> nn.Sequential:
    """``gpt`` in float32."""
    return gpt(dtype=torch.float32, seed=seed)


def gpt_lm(batch: int = 8) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """``gpt32``, a batch of its ids and their targets: a ``fastpipe plan``
    factory that gives the target ``--loss`` needs."""
    return (gpt32(), *gpt_batch(batch))


def lm_loss(logits, targets):
    """Next-token cross-entropy: logits (batch, seq, vocab), targets (batch, seq)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(batch: int, vocab: int = 32, seq: int = 8, seed: int = 0):
    """Token ids and next-token targets for ``gpt``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# --- Hugging Face causal LMs (fastpipe.hf) -----------------------------------
#
# Tiny configurations built here (nothing downloaded), float64, no dropout,
# tied input and output embeddings. transformers is imported on first use.

HF_VOCAB = 64


def hf_gpt2_lm(seed: int = 0, attn: str = "sdpa"):
    """A 4-block GPT2LMHeadModel (Conv1D projections, learned positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=HF_VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                        bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return GPT2LMHeadModel(config).to(torch.float64)


def hf_llama_lm(seed: int = 0, attn: str = "sdpa"):
    """A 4-layer LlamaForCausalLM: RMSNorm, rotary positions, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=HF_VOCAB,
                         max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0, attn_implementation=attn)
    return LlamaForCausalLM(config).to(torch.float64)


def hf_gpt2(seed: int = 0) -> nn.Sequential:
    """``hf_gpt2_lm`` through ``fastpipe.hf.causal_lm``: 7 layers, the head tied to layer 0."""
    from fastpipe.hf import causal_lm

    return causal_lm(hf_gpt2_lm(seed))


def hf_llama(seed: int = 0) -> nn.Sequential:
    """``hf_llama_lm`` through ``fastpipe.hf.causal_lm``: 7 layers, the head tied to layer 0."""
    from fastpipe.hf import causal_lm

    return causal_lm(hf_llama_lm(seed))


def hf_lm_loss(logits, labels):
    """``fastpipe.hf.lm_loss``: shifted next-token cross-entropy, -100 ignored."""
    from fastpipe.hf import lm_loss

    return lm_loss(logits, labels)


def hf_batch(rows: int, seq: int = 8, padding: str | None = None, seed: int = 0):
    """``(input_ids, labels)``, or with ``padding`` ("left" or "right")
    ``((input_ids, attention_mask), labels)``: row ``i`` has ``i % 3`` padded
    positions on that side, their labels -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(HF_VOCAB, (rows, seq), generator=g)
    if padding is None:
        return ids, ids.clone()
    if padding not in ("left", "right"):
        raise ValueError(f"padding must be None, 'left' or 'right', got {padding!r}")
    mask = torch.ones_like(ids)
    for i in range(rows):
        pad = i % 3
        if pad and padding == "left":
            mask[i, :pad] = 0
        elif pad:
            mask[i, seq - pad:] = 0
    return (ids, mask), ids.masked_fill(mask == 0, -100)
