"""fastpipe.hf: a transformers causal LM as an nn.Sequential trains in a Pipe
exactly as the model's own forward and backward would."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from fastpipe import Pipe  # noqa: E402
from fastpipe.hf import causal_lm, lm_loss  # noqa: E402
from fastpipe.schedules import names  # noqa: E402
from tests import models  # noqa: E402
from tests._dist_worker import SPR  # noqa: E402

CHUNKS = 4
BUILDERS = {"gpt2": models.hf_gpt2_lm, "llama": models.hf_llama_lm}


def _hf_reference(hf, x, labels, chunks: int):
    """Loss and grads (by transformers' names) of the model's own forward over
    the same microbatches: mean over microbatches of lm_loss."""
    ids, mask = x if isinstance(x, tuple) else (x, None)
    masks = torch.tensor_split(mask, chunks) if mask is not None else [None] * chunks
    total = 0
    for i, m, y in zip(torch.tensor_split(ids, chunks), masks, torch.tensor_split(labels, chunks)):
        total = total + lm_loss(hf(input_ids=i, attention_mask=m).logits, y)
    loss = total / chunks
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in hf.named_parameters()}


def _pipe_matches_hf(family: str, schedule: str, padding: str | None, attn: str = "sdpa",
                     **options) -> None:
    hf = BUILDERS[family](attn=attn)
    ref = copy.deepcopy(hf)
    x, labels = models.hf_batch(10, padding=padding)
    pipe = Pipe(causal_lm(hf), chunks=CHUNKS, schedule=schedule, devices=["cpu", "cpu"],
                stages_per_rank=SPR.get(schedule), **options)
    loss = pipe.step(x, labels, lm_loss)
    want_loss, want = _hf_reference(ref, x, labels, CHUNKS)
    torch.testing.assert_close(loss, want_loss)
    got = {n: p.grad for n, p in hf.named_parameters()}
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert g is not None and got[name] is not None, name
        torch.testing.assert_close(got[name], g, msg=f"{family} {schedule} {padding}: {name}")


# Every schedule on both families with plain ids; padding on each side for
# each family, alternating over the schedules to keep the matrix small.
CASES = [(f, s, None) for f in BUILDERS for s in names()]
CASES += [(f, s, ("left", "right")[(i + j) % 2]) for j, f in enumerate(BUILDERS)
          for i, s in enumerate(names())]


@pytest.mark.parametrize("family,schedule,padding", CASES)
def test_pipe_grads_equal_the_models_own(family, schedule, padding):
    """Gradients and loss of a 2-rank Pipe over causal_lm(model) are those of
    the model's own forward (and loss) over the same microbatches."""
    _pipe_matches_hf(family, schedule, padding)


OPTIONS = [("1f1b", {"fused_wgrad": False}), ("1f1b", {"checkpoint": "always"}),
           ("zbv", {"checkpoint": "except_last"}), ("1f1b", {"recompute": "selective"})]


@pytest.mark.parametrize("family", BUILDERS)
def test_pipe_options_keep_the_models_grads(family):
    """Autograd's own B (fused_wgrad=False), recomputation in backward (the layer members
    rebuild mask and rotary embeddings again) and selective recompute."""
    for schedule, options in OPTIONS:
        _pipe_matches_hf(family, schedule, "left", **options)


def test_eager_attention_with_padding():
    """Eager attention builds its mask as a float tensor: the same gradients.
    (Llama with right padding: in float64 its eager attention turns a fully
    masked query row, a left-padded token, into NaN in the model's own
    forward too.)"""
    _pipe_matches_hf("llama", "1f1b", "right", attn="eager")
    _pipe_matches_hf("gpt2", "zb-h1", "left", attn="eager")


def test_layers_share_the_models_modules():
    hf = models.hf_llama_lm()
    model = causal_lm(hf)
    assert len(model) == 1 + 4 + 2
    assert model[0].embed_tokens is hf.model.embed_tokens
    assert [m.layer for m in model[1:5]] == list(hf.model.layers)
    assert model[-2].norm is hf.model.norm and model[-1].lm_head is hf.lm_head
    assert model[-1].lm_head.weight is model[0].embed_tokens.weight  # the tie stays a tie
    rotary = [m.rotary_emb for m in model[1:5]]
    assert len({id(r) for r in rotary} | {id(hf.model.rotary_emb)}) == 5  # one copy per layer
    assert model[1].rotary_emb.config is hf.config
    assert {id(p) for p in model.parameters()} == {id(p) for p in hf.parameters()}
    gpt2 = models.hf_gpt2_lm()
    keys = [n for n, _ in causal_lm(gpt2).named_parameters()]
    assert keys[:2] == ["0.wte.weight", "0.wpe.weight"] and "5.ln_f.weight" in keys


def test_lm_loss_equals_the_models_own_loss():
    """float32: lm_loss of the logits is the model's loss given labels, padding ignored."""
    for build in BUILDERS.values():
        hf = build().float()
        (ids, mask), labels = models.hf_batch(6, padding="right", seed=3)
        out = hf(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(lm_loss(out.logits, labels), out.loss)
        out = hf(input_ids=ids, labels=ids)
        torch.testing.assert_close(lm_loss(out.logits, ids), out.loss)
    assert lm_loss(out.logits.bfloat16(), ids).dtype == torch.bfloat16  # no upcast
    with pytest.raises(ValueError, match=r"labels of shape \(6, 7\)"):
        lm_loss(out.logits, ids[:, 1:])


SMALL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=64, max_position_embeddings=32)


def test_sliding_window_families():
    """Mistral and Qwen2 with sliding windows shorter than the sequence: each
    layer gets the mask its own forward gives it. With a window longer than
    the check's sequences (Mistral's default), the check shortens it while it
    runs, so a model whose forward ignores its window (Llama given one) is
    refused rather than masked wrongly."""
    import transformers

    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=3))
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=1))
    assert qwen.config.layer_types == ["full_attention", "sliding_attention"]
    (ids, mask), _ = models.hf_batch(3, seq=8, padding="left")
    for hf in (mistral, qwen):
        model = causal_lm(hf)
        torch.testing.assert_close(model((ids, mask)), hf(input_ids=ids, attention_mask=mask).logits)
    default = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL))
    assert default.config.sliding_window == 4096
    causal_lm(default)
    assert default.config.sliding_window == 4096  # restored
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    llama.config.sliding_window = 4096  # Llama's forward never reads it
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported: its forward does more"):
        causal_lm(llama)


def test_the_check_refuses_a_forward_that_does_more():
    """Cohere scales its logits: the standard pieces miss that, and the check says so."""
    import transformers

    torch.manual_seed(0)
    config = transformers.CohereConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                       intermediate_size=64, vocab_size=64, logit_scale=0.5)
    with pytest.raises(ValueError, match="CohereForCausalLM is not supported: its forward does more"):
        causal_lm(transformers.CohereForCausalLM(config))
    model = causal_lm(transformers.CohereForCausalLM(config), check=False)  # on request
    assert len(model) == 4


def test_the_check_restores_training_flags_and_skips_meta():
    hf = models.hf_gpt2_lm()
    hf.transformer.h[1].eval()
    before = {n: m.training for n, m in hf.named_modules()}
    model = causal_lm(hf)
    assert {n: m.training for n, m in hf.named_modules()} == before
    assert model[3].layer.training and not model[2].layer.training  # shared: the same modules
    with torch.device("meta"):
        meta = models.hf_llama_lm()
    with pytest.warns(UserWarning, match="is on the meta device, so its output could not be compared"):
        assert causal_lm(meta)[1].layer.mlp.up_proj.weight.is_meta  # no check, no failure


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_built_on_meta_loads_by_its_own_names_and_trains(family):
    """Built on the meta device: each layer's rotary embedding is made from
    the config (no checkpoint holds its buffers), the Pipe makes the
    stages' tensors, and the model's own state dict loaded into the model
    itself writes them in place: the step is the model's own."""
    with torch.device("meta"):
        hf = BUILDERS[family]()
        model = causal_lm(hf, check=False)  # nothing to compare on meta
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert all(not b.is_meta for m in rotary for b in m.buffers())
    assert len(rotary) == (len(model) - 3 if family == "llama" else 0)  # one per layer
    pipe = Pipe(model, chunks=CHUNKS, schedule="zbv", devices=["cpu", "cpu"], balance=[1, 2, 2, 2])
    try:
        ref = BUILDERS[family]()
        hf.load_state_dict(ref.state_dict())
        x, labels = models.hf_batch(8, padding="right")
        loss = pipe.step(x, labels, lm_loss)
        want_loss, want = _hf_reference(ref, x, labels, CHUNKS)
        torch.testing.assert_close(loss, want_loss)
        for name, p in hf.named_parameters():
            torch.testing.assert_close(p.grad, want[name], msg=name)
    finally:
        pipe.close()


def test_unsupported_models_are_named():
    import transformers

    with pytest.raises(TypeError, match="Linear is not a transformers causal LM"):
        causal_lm(torch.nn.Linear(2, 2))
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, ffn_dim=64, vocab_size=64,
        word_embed_proj_dim=32))
    with pytest.raises(ValueError, match="OPTForCausalLM is not supported: its config has no base_model_pp"):
        causal_lm(opt)
    llama = models.hf_llama_lm()
    llama.config.base_model_pp_plan = {"layers": (["hidden_states", "attention_mask"],
                                                  ["hidden_states"]), "norm": (["hidden_states"], ["hidden_states"])}
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported: its base_model_pp_plan"):
        causal_lm(llama)


@pytest.mark.parametrize("family", ["phi", "gpt_neox", "qwen3"])
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_more_families_train_as_their_own_forward(family, schedule):
    """Phi and GPT-NeoX run a dropout on the embeddings before their layers
    (a piece of their base_model_pp_plan between the embedding and the
    layers), GPT-NeoX's head is untied; Qwen3 normalises its queries and
    keys. Each through a Pipe, left padding: the model's own grads."""
    import transformers

    kinds = {"phi": ("PhiConfig", "PhiForCausalLM"), "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config, lm = (getattr(transformers, k) for k in kinds[family])
    torch.manual_seed(0)
    hf = lm(config(**SMALL, head_dim=8, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                   attn_implementation="sdpa")).double()
    model = causal_lm(hf)
    assert model[-1].head is hf.get_output_embeddings()
    ref = copy.deepcopy(hf)
    x, labels = models.hf_batch(8, padding="left")
    pipe = Pipe(model, chunks=CHUNKS, schedule=schedule, devices=["cpu", "cpu"],
                stages_per_rank=SPR.get(schedule))
    loss = pipe.step(x, labels, lm_loss)
    want_loss, want = _hf_reference(ref, x, labels, CHUNKS)
    torch.testing.assert_close(loss, want_loss)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with pytest.raises(ImportError, match=r"pip install fastpipe\[hf\]"):
        causal_lm(models.hf_gpt2_lm())


def test_import_does_not_load_transformers():
    code = "import sys, fastpipe; print(fastpipe.hf.__name__, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["fastpipe.hf", "False"]
