"""Train a Hugging Face causal LM with data x pipeline parallelism; save and resume.

Four processes as a ("dp", "pp") = (2, 2) mesh: two replicas of a two-rank
pipeline, each on its half of every batch. On CPUs (gloo):

    torchrun --nproc-per-node 4 examples/hf_dp_pp.py --dp 2 --steps 60 --save-at 50 --checkpoint ckpt
    torchrun --nproc-per-node 4 examples/hf_dp_pp.py --dp 2 --steps 60 --checkpoint ckpt --resume

On GPUs the same command uses NCCL, one GPU per process. The second command
starts a new process group, builds the model on the meta device (each rank
then makes only its own stages), loads the model and AdamW state saved at
step 50 with torch.distributed.checkpoint, and trains steps 50-59 again:
its losses are the first run's. The checkpoint also loads into another layout (another
--dp, --schedule or number of processes) or into the plain model.

The model is built from a small config (no download); the data are
sequences that follow a rule per row (a start and a stride), padded to
different lengths, so the loss has something to learn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from fastpipe import Pipe
from fastpipe.hf import causal_lm, lm_loss

# Optimizer state by parameter name, so that it reshards across layouts.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
V_SHAPED = {"zbv": 2, "dualpipev": 2, "interleaved-1f1b": 2, "looped-bfs": 2}


def build_model(family: str, vocab: int, layers: int, width: int):
    """A small causal LM from a config, the same weights on every rank (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_positions=256, n_embd=width, n_layer=layers,
                            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def batch(step: int, rows: int, seq: int, vocab: int):
    """(input_ids, attention_mask, labels) of global batch ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab
    lengths = torch.randint(seq // 2, seq + 1, (rows, 1), generator=g)
    mask = (torch.arange(seq) < lengths).long()  # right padding
    return ids, mask, ids.masked_fill(mask == 0, -100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas (processes / dp per pipeline)")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--chunks", type=int, default=4, help="microbatches per replica and step")
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (rows), split over the replicas")
    p.add_argument("--steps", type=int, default=60, help="train up to this step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder")
    p.add_argument("--save-at", type=int, help="save after this many steps (default: at the end)")
    p.add_argument("--resume", action="store_true", help="load --checkpoint and go on from its step")
    p.add_argument("--losses-to", help="write rank 0's losses to this JSON file")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the {world} processes")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (args.dp, world // args.dp),
                            mesh_dim_names=("dp", "pp"))

    # A resume needs no initial weights: built on the meta device, each rank
    # makes only its own stages' tensors, which the checkpoint then fills
    # (causal_lm's check needs real weights: the first run made it).
    with torch.device("meta") if args.resume else contextlib.nullcontext():
        hf = build_model(args.model, args.vocab, args.layers, args.width)
    pipe = Pipe(causal_lm(hf, check=not args.resume), chunks=args.chunks, schedule=args.schedule,
                mesh=mesh, stages_per_rank=V_SHAPED.get(args.schedule))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)  # this rank's parameters

    step = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(pipe, optimizer, options=OPTIONS)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(pipe, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=OPTIONS)
        step = int(state["step"])

    replica, replicas = mesh.get_local_rank("dp"), args.dp
    losses = {}
    while step < args.steps:
        ids, mask, labels = (t.tensor_split(replicas)[replica] for t in batch(step, args.batch,
                                                                               args.seq, args.vocab))
        optimizer.zero_grad()
        loss = pipe.step((ids, mask), labels, lm_loss)  # the mean over every replica
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        step += 1
        losses[step] = loss.item()
        if dist.get_rank() == 0:
            print(f"step {step:4d}  loss {losses[step]:.4f}", flush=True)
        if step == (args.save_at or args.steps):
            model_sd, optim_sd = get_state_dict(pipe, optimizer, options=OPTIONS)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
                     checkpoint_id=args.checkpoint)
            if dist.get_rank() == 0:
                print(f"saved step {step} to {args.checkpoint}", flush=True)
    if args.losses_to and dist.get_rank() == 0:
        with open(args.losses_to, "w") as f:
            json.dump(losses, f)
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
