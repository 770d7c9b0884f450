"""Hugging Face causal language models as an ``nn.Sequential`` a ``Pipe`` can split.

A transformers causal LM runs its decoder layers inside one ``forward`` that
also builds the attention mask, the position ids and the rotary embeddings
once for all layers. ``causal_lm`` lays the same model out flat: embeddings,
one member per decoder layer, the final norm, the head. Between members
travels only ``hidden`` or ``(hidden, attention_mask)``, tensors a pipeline
can send between ranks; each layer member rebuilds what its layer needs from
them with transformers' own functions, so every stage computes what the
model's own forward computes.

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from fastpipe import Pipe
    >>> from fastpipe.hf import causal_lm, lm_loss
    >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64))
    >>> model = causal_lm(hf)   # Embeddings, 2 layers, ln_f, lm_head
    >>> pipe = Pipe(model, chunks=4, devices=["cpu", "cpu"])
    >>> loss = pipe.step((input_ids, attention_mask), labels, lm_loss)
"""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["causal_lm", "lm_loss"]

# What travels between the members: hidden states (batch, seq, d), with the
# 2-D padding mask (batch, seq) of 0/1 beside them when the input had one.
_Value = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# The pieces of a base model, as its config's ``base_model_pp_plan`` names
# them: (inputs, outputs) of the embedding, the layers and the final norm;
# between the embedding and the layers, pieces of the embeddings' output
# (a dropout) may come, in the plan's order.
_EMBEDDING = (("input_ids",), ("inputs_embeds",))
_ON_EMBEDDINGS = ("inputs_embeds",)
_LAYERS = (("hidden_states", "attention_mask"), ("hidden_states",))
_NORM = (("hidden_states",), ("hidden_states",))
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


def causal_lm(model: nn.Module, *, check: bool = True) -> nn.Sequential:
    """The causal LM ``model`` as ``nn.Sequential(embeddings, layer 0, ...,
    layer N-1, final norm, head)``, for a ``Pipe`` to split.

    Supported: ``GPT2LMHeadModel``, and models whose config's
    ``base_model_pp_plan`` has the standard pieces (an embedding of the
    ids, optionally pieces on its output such as a dropout, the layers, the
    final norm) with a ``rotary_emb`` on the base model (Llama, Qwen2/3,
    Mistral, Gemma, Phi-3, OLMo-2, Granite, Phi, GPT-NeoX; sliding-window
    layers get transformers' own mask). The head is the model's output
    embeddings (``get_output_embeddings()``).
    The members hold the model's own modules (each layer gets a copy of the
    buffer-only rotary embedding, made from the config on the CPU for a
    model built on the meta device): parameters are shared, ties stay ties,
    names keep transformers' attributes (``0.wte.weight``, ...).

    Input: ``input_ids`` (batch, seq), or ``(input_ids, attention_mask)``
    with a 0/1 mask; padding is masked as the model's own forward masks it.
    Output: logits (batch, seq, vocab). ``docs/design/hf.md`` says how.

    Args:
        model: a transformers causal LM (``...ForCausalLM``, ``GPT2LMHeadModel``).
        check: run the model and the Sequential once (eval mode, no grad)
            and refuse a model whose forward does more than the standard
            pieces (scaled embeddings, soft-capped logits); on the meta
            device it cannot run, and a UserWarning says so.

    Returns:
        The ``nn.Sequential``.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` is not a causal LM with a ``base_model`` and output
            embeddings of its own.
        ValueError: the model's layout is not one of the supported ones, or
            (``check``) its logits differ from the Sequential's beyond the
            tolerance ``torch.testing.assert_close`` uses for their dtype.

    Example:
        >>> model = causal_lm(LlamaForCausalLM(config))
        >>> logits = model((input_ids, attention_mask))
    """
    masking = _masking_utils()
    name = type(model).__name__
    base = getattr(model, "base_model", None)
    head_name = _head_name(model)
    if not isinstance(base, nn.Module) or head_name is None:
        raise TypeError(f"{name} is not a transformers causal LM: need a base_model and output "
                        "embeddings (get_output_embeddings()) held by the model itself")
    config = base.config
    if getattr(config, "model_type", None) == "gpt2":
        embed: nn.Module = _GPT2Embeddings(base.wte, base.wpe, base.drop)
        layers, norm_name, rotary = base.h, "ln_f", None
    else:
        embed_names, layers_name, norm_name = _standard_pieces(base, name)
        embed = _Embeddings({n: getattr(base, n) for n in embed_names})
        layers, rotary = getattr(base, layers_name), base.rotary_emb
    count = getattr(config, "num_hidden_layers", len(layers))
    members = [embed]
    for i, layer in enumerate(layers[:count]):
        own = _own_rotary(rotary, config) if rotary is not None else None
        members.append(_DecoderLayer(layer, config, _mask_function(masking, config, i, name), own))
    seq = nn.Sequential(*members, _FinalNorm(norm_name, getattr(base, norm_name)),
                        _Head(head_name, getattr(model, head_name)))
    if check:
        _check(model, seq, name)
    return seq


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token cross-entropy, as transformers' causal LMs compute it.

    ``labels`` (batch, seq) are the input ids themselves (``ignore_index``
    where no loss is wanted, e.g. padding): position ``t`` of ``logits``
    (batch, seq, vocab) predicts ``labels[:, t + 1]``; the last position
    predicts nothing. The mean is over the tokens not ignored (NaN if
    there are none, as in transformers). Computed in the logits' dtype:
    transformers' own loss upcasts the logits to float32 first, so the two
    agree exactly in float32 and float64 and up to rounding in lower
    precision.

    Example:
        >>> loss = pipe.step((input_ids, attention_mask), labels, lm_loss)
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match logits of shape "
                         f"{tuple(logits.shape)}: need labels (batch, seq) for logits (batch, seq, vocab)")
    # (batch, seq) -> shifted left by one, ignore_index after the last token
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    return F.cross_entropy(logits.flatten(0, -2), shifted.flatten(), ignore_index=ignore_index)


# --- the members ------------------------------------------------------------------


def _split(value: _Value) -> tuple[torch.Tensor, torch.Tensor | None]:
    return value if isinstance(value, tuple) else (value, None)


def _join(hidden: torch.Tensor, mask: torch.Tensor | None) -> _Value:
    return hidden if mask is None else (hidden, mask)


def _check_mask(ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not match input_ids of "
                         f"shape {tuple(ids.shape)}")


class _Embeddings(nn.Module):
    """Token ids (batch, seq) -> the embedding module's hidden states, then
    the pieces the model runs on them before its layers, in order."""

    def __init__(self, pieces: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in pieces.items():
            self.add_module(name, module)

    def forward(self, value: _Value) -> _Value:
        ids, mask = _split(value)
        _check_mask(ids, mask)
        hidden = ids
        for piece in self._modules.values():
            hidden = piece(hidden)
        return _join(hidden, mask)


class _GPT2Embeddings(nn.Module):
    """GPT-2's input: token plus learned position embeddings, then dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, value: _Value) -> _Value:
        ids, mask = _split(value)
        _check_mask(ids, mask)
        positions = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)  # (1, seq)
        return _join(self.drop(self.wte(ids) + self.wpe(positions)), mask)


class _DecoderLayer(nn.Module):
    """One decoder layer, given what the model's forward would give it: the
    4-D mask from the 2-D one, position ids ``0..seq-1`` and (rotary models)
    the position embeddings, made here from the hidden states' shape."""

    def __init__(self, layer: nn.Module, config: Any, make_mask: _MaskCall,
                 rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        if rotary is not None:
            self.rotary_emb = rotary
        self.config, self.make_mask = config, make_mask
        accepted = inspect.signature(layer.forward).parameters
        offered = ("attention_mask", "position_ids", "cache_position", "use_cache", *_CACHE_NAMES,
                   *(("position_embeddings",) if rotary is not None else ()))
        self.takes = {k for k in offered if k in accepted}

    def forward(self, value: _Value) -> _Value:
        hidden, mask = _split(value)
        positions = torch.arange(hidden.shape[1], device=hidden.device)  # (seq,)
        given = {"attention_mask": self.make_mask(self.config, hidden, mask, positions),
                 "position_ids": positions.unsqueeze(0), "cache_position": positions, "use_cache": False}
        if "position_embeddings" in self.takes:
            given["position_embeddings"] = self.rotary_emb(hidden, positions.unsqueeze(0))
        out = self.layer(hidden, **{k: given.get(k) for k in self.takes})
        return _join(out[0] if isinstance(out, tuple) else out, mask)


class _FinalNorm(nn.Module):
    """The final norm; the padding mask stops here."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, module)

    def forward(self, value: _Value) -> torch.Tensor:
        return self._modules[self.name](_split(value)[0])


class _Head(nn.Module):
    """Hidden states (batch, seq, d) -> logits (batch, seq, vocab)."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, module)

    @property
    def head(self) -> nn.Module:
        """The model's output embeddings, under the model's own attribute name."""
        return self._modules[self.name]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


# --- finding the pieces -----------------------------------------------------------


def _masking_utils() -> ModuleType:
    try:
        return importlib.import_module("transformers.masking_utils")
    except ImportError as exc:
        raise ImportError(f"fastpipe.hf needs transformers ({exc}): pip install fastpipe[hf]") from exc


def _head_name(model: nn.Module) -> str | None:
    """The attribute of ``model`` holding its output embeddings (the head)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        return None
    return next((n for n, m in model.named_children() if m is head), None)


def _standard_pieces(base: nn.Module, name: str) -> tuple[list[str], str, str]:
    """The attribute names of the embedding (and of the pieces run on its
    output before the layers), of the layers and of the final norm."""
    plan = getattr(base.config, "base_model_pp_plan", None)
    if not plan:
        raise ValueError(f"{name} is not supported: its config has no base_model_pp_plan "
                         "and it is not GPT-2")
    pieces = list(plan)
    shapes = [(tuple(i), tuple(o)) for i, o in plan.values()]
    standard = (len(shapes) >= 3 and shapes[0] == _EMBEDDING and shapes[-2:] == [_LAYERS, _NORM]
                and all(i == _ON_EMBEDDINGS for i, _ in shapes[1:-2]))
    if not standard or not hasattr(base, "rotary_emb"):
        raise ValueError(f"{name} is not supported: its base_model_pp_plan {dict(plan)} is not "
                         "an embedding of input_ids (then pieces of its output), a list of layers "
                         "and a final norm with a rotary_emb on the base model")
    if not isinstance(getattr(base, pieces[-2], None), nn.ModuleList):
        raise ValueError(f"{name} is not supported: base_model.{pieces[-2]} is not an nn.ModuleList")
    return pieces[:-2], pieces[-2], pieces[-1]


_MASK_MAKERS = {"full_attention": "create_causal_mask",
                "sliding_attention": "create_sliding_window_causal_mask"}


def _mask_function(masking: ModuleType, config: Any, index: int, name: str) -> _MaskCall:
    """How layer ``index`` gets its mask, as the model's forward chooses it:
    by ``config.layer_types``, else sliding wherever a window is set."""
    types = getattr(config, "layer_types", None)
    windowed = getattr(config, "sliding_window", None) is not None
    kind = types[index] if types else ("sliding_attention" if windowed else "full_attention")
    if kind not in _MASK_MAKERS:
        raise ValueError(f"{name} is not supported: layer {index} is of type {kind!r}, "
                         f"not one of {sorted(_MASK_MAKERS)}")
    return _MaskCall(getattr(masking, _MASK_MAKERS[kind]))


class _MaskCall:
    """``fn(config, hidden, mask, positions)`` with the keywords the installed
    transformers names (they moved between 5.x releases), read once.

    Positions here are always ``0..seq-1``. Given ``position_ids``, the mask
    functions only look for packed sequences in them (none: the same mask),
    which cost most of a mask's time on small layers, once per layer; so
    they are passed only where a release requires them."""

    def __init__(self, fn: Callable) -> None:
        accepted = inspect.signature(fn).parameters
        self.fn = fn
        self.embeds = "inputs_embeds" if "inputs_embeds" in accepted else "input_embeds"
        self.cache = next((k for k in _CACHE_NAMES if k in accepted), None)
        self.cache_position = "cache_position" in accepted
        ids = accepted.get("position_ids")
        self.position_ids = ids is not None and ids.default is inspect.Parameter.empty

    def __call__(self, config: Any, hidden: torch.Tensor, mask: torch.Tensor | None,
                 positions: torch.Tensor) -> Any:
        given = {"config": config, self.embeds: hidden, "attention_mask": mask}
        if self.position_ids:
            given["position_ids"] = positions.unsqueeze(0)
        if self.cache is not None:
            given[self.cache] = None
        if self.cache_position:
            given["cache_position"] = positions
        return self.fn(**given)


# --- the safety net ---------------------------------------------------------------


def _own_rotary(rotary: nn.Module, config: Any) -> nn.Module:
    """A layer's own copy of the base model's rotary embedding, which holds
    only buffers computed from the config. For a model built on the meta
    device it is made anew from the config on the CPU (where its class
    takes the config alone and makes the same buffers): no checkpoint holds
    those buffers (``persistent=False``), so nothing would write them once
    a Pipe made the layer's tensors."""
    if any(b.is_meta for b in rotary.buffers()):
        try:
            with torch.device("cpu"):
                own = type(rotary)(config)
        except TypeError:
            own = None
        want = _buffer_shapes(rotary)
        if own is not None and _buffer_shapes(own) == want and not any("." in n for n in want):
            for n, b in rotary.named_buffers():  # in the model's dtypes (a .double() casts them)
                own._buffers[n] = own._buffers[n].to(b.dtype)
            return own
    return copy.deepcopy(rotary, memo={id(config): config})


def _buffer_shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {n: b.shape for n, b in module.named_buffers()}


def _check(model: nn.Module, seq: nn.Sequential, name: str) -> None:
    """Raises ValueError if ``seq`` and ``model`` disagree on a small padded batch."""
    weight = next(model.parameters(), None)
    if weight is None:
        return
    if weight.is_meta:
        warnings.warn(f"causal_lm: {name} is on the meta device, so its output could not be "
                      "compared with the Sequential's (a forward that scales or caps the logits "
                      "would go unnoticed); run causal_lm once on a small instance of the same "
                      "class with real weights to check it, or pass check=False", stacklevel=3)
        return
    vocab = getattr(seq[-1].head, "out_features", None) or model.config.vocab_size
    ids = torch.randint(vocab, (2, 8), generator=torch.Generator().manual_seed(0)).to(weight.device)
    mask = torch.ones_like(ids)
    mask[1, -1] = 0  # right padding: no query is left with nothing to attend to
    modes = [(m, m.training) for m in (*model.modules(), *seq.modules())]
    try:
        model.eval()
        seq.eval()
        with torch.no_grad(), _short_window(model.config, ids.shape[1]):
            want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = seq((ids, mask))
    finally:
        for m, training in modes:
            m.training = training
    try:
        torch.testing.assert_close(got, want.to(got.dtype))
    except AssertionError as exc:
        raise ValueError(f"{name} is not supported: its forward does more than embeddings, "
                         f"decoder layers, final norm and head (the logits differ: {exc})") from None


@contextmanager
def _short_window(config: Any, tokens: int) -> Iterator[None]:
    """A sliding window shorter than the check's sequences while it runs, so
    a layer masked with the wrong kind of mask changes the logits."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < tokens:
        yield
        return
    config.sliding_window = tokens // 2
    try:
        yield
    finally:
        config.sliding_window = window
