"""Pipeline a Hugging Face causal LM: GPT-2 or Llama, from a config or from the Hub.

    pip install "fastpipe[hf]"
    python examples/hf_causal_lm.py                          # a small GPT-2 from a config
    python examples/hf_causal_lm.py --model llama --schedule zbv
    python examples/hf_causal_lm.py --pretrained gpt2        # downloads the weights

``fastpipe.hf.causal_lm`` lays the model out as an ``nn.Sequential``
(embeddings, one member per decoder layer, final norm, head) that shares the
model's own parameters, so tied embeddings stay tied and the model trains
in place: ``model.save_pretrained`` afterwards saves what the pipeline trained.
"""

from __future__ import annotations

import argparse

import torch

from fastpipe import Pipe
from fastpipe.hf import causal_lm, lm_loss
from tiny_gpt import batch

V_SHAPED = {"zbv": 2, "dualpipev": 2, "interleaved-1f1b": 2, "looped-bfs": 2}  # stages per rank


def build(name: str, layers: int, width: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=256, n_embd=width,
                                          n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=256,
                                        tie_word_embeddings=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--pretrained", help="a Hub name to load instead (e.g. gpt2)")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--devices", nargs="+", help="one per pipeline rank (default: 2 GPUs or 2 CPUs)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    args = p.parse_args()

    if args.pretrained:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.pretrained)
    else:
        hf = build(args.model, args.layers, args.width, vocab=256)
    vocab = hf.config.vocab_size
    devices = args.devices or (["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"])
    pipe = Pipe(causal_lm(hf), chunks=args.chunks, schedule=args.schedule, devices=devices,
                stages_per_rank=V_SHAPED.get(args.schedule))
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    for step in range(1, args.steps + 1):
        ids, _ = batch(step, args.batch, args.seq, vocab)
        mask = torch.ones_like(ids)  # 0 where a row is padding
        optimizer.zero_grad()
        loss = pipe.step((ids, mask), ids, lm_loss)  # lm_loss shifts the labels itself
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    pipe.close()


if __name__ == "__main__":
    main()
