"""Cost of the zero-bubble backward split: I + W against one plain B.

A stage of the GPT workload (two pre-LN blocks) and one of the MLP
workload (four Linear/GELU/Linear blocks), one microbatch, one thread. B is
autograd's backward of the plain forward. I + W is what a split schedule
runs (``fastpipe.runtime.deferred``): the forward with the layers
deferring, I one engine call that leaves each layer's weight work behind,
W that work. B and I + W are timed in alternation so drift hits both alike;
the report is their medians and the ratio (I+W)/B (1.0: the split is free).

    python -m bench iw_split [--repeats N] [--device cpu|cuda] [--bf16]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fastpipe.runtime import deferred
from tests.models import Block

# name: (stage builder, input shape (batch, seq, d) or (rows, width))
STAGES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "gpt block x2 d=256 seq=64": (lambda: nn.Sequential(Block(256, 4), Block(256, 4)), (1, 64, 256)),
    "gpt block x2 d=64 seq=16": (lambda: nn.Sequential(Block(64, 2), Block(64, 2)), (2, 16, 64)),
    "mlp x4 d=512 rows=8": (lambda: nn.Sequential(*[nn.Sequential(
        nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(4)]), (8, 512)),
}


def _hf_layers(workload: str) -> nn.Module:
    """Two decoder layers of a ``bench._workloads`` Hugging Face model."""
    from bench._workloads import WORKLOADS

    return nn.Sequential(*list(WORKLOADS[workload].build())[1:3])


if importlib.util.find_spec("transformers") is not None:
    STAGES["hf-gpt2 layer x2 d=256 seq=64"] = (lambda: _hf_layers("hf-gpt2-compute"), (1, 64, 256))
    STAGES["hf-llama layer x2 d=256 seq=64"] = (lambda: _hf_layers("hf-llama-compute"), (1, 64, 256))


def measure(build: Callable[[], nn.Module], shape: tuple[int, ...], repeats: int,
            device: str = "cpu", bf16: bool = False) -> tuple[float, float, float]:
    """Median seconds of (B, I, W) for one microbatch through one stage
    whose input needs a gradient."""
    torch.manual_seed(0)
    stage = build().to(device)
    x = torch.randn(shape, device=device)
    g = torch.randn(shape, device=device)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    layers = deferred.install(stage)
    params = list(stage.parameters())
    b_times, i_times, w_times = [], [], []
    try:
        for _ in range(repeats):
            xi = x.clone().requires_grad_()
            with amp:
                y = stage(xi)  # no Pending collecting: the plain forward
            sync()
            t0 = time.perf_counter()
            y.backward(g.to(y.dtype))
            sync()
            b_times.append(time.perf_counter() - t0)
            xi = x.clone().requires_grad_()
            pending = deferred.Pending()
            with amp, deferred.collecting(pending):
                y = stage(xi)
            sync()
            t0 = time.perf_counter()
            deferred.backward_input([y], [g.to(y.dtype)], [xi], params, pending)
            sync()
            t1 = time.perf_counter()
            deferred.run_weight(pending.entries, calls=pending.calls)
            sync()
            i_times.append(t1 - t0)
            w_times.append(time.perf_counter() - t1)
    finally:
        deferred.uninstall(layers)
    return statistics.median(b_times), statistics.median(i_times), statistics.median(w_times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench iw_split", description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="forward under bf16 autocast")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"I+W against B, one microbatch, {args.device}{', bf16 autocast' if args.bf16 else ''}")
    print(f"  {'stage':<32}{'B ms':>8}{'I ms':>8}{'W ms':>8}{'(I+W)/B':>9}")
    for name, (build, shape) in STAGES.items():
        b, i, w = measure(build, shape, args.repeats, args.device, args.bf16)
        print(f"  {name:<32}{b * 1e3:>8.3f}{i * 1e3:>8.3f}{w * 1e3:>8.3f}{(i + w) / b:>9.3f}")
    return 0
