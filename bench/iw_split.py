"""Cost of the zero-bubble backward split: I + W against one plain B.

The stage is half of the compute-bound pipelining model (4 MLP blocks,
d=512) on one microbatch of the pipelining benchmark (8 rows), one thread,
measured twice: as a later stage (its input needs a gradient, I computes
it) and as the first stage (the model's input needs none: I has nothing to
do and W runs the whole backward). B, I and W are timed in alternation so
drift hits both sides alike. W runs as the executor runs it, with a
workspace kept across microbatches (``backward_weight(workspace=...)``).

With ``--fused-wgrad`` all three run as ``Pipe(fused_wgrad=True)`` runs
them (each Linear's weight gradient one GEMM into ``.grad``): I+W is then
compared with a fused B.

The "chain" rows split the same stage the way the executor runs it now
(``fastpipe.runtime.chain``: the stage holds only Linears and GELUs, so
forward, I and W run as native ops without autograd's graph), against the
same autograd B, timed in alternation with it. A chain's own B is its I
then its W.

    python -m bench iw_split [--repeats N] [--rows R] [--fused-wgrad]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fastpipe.runtime._backward import backward_full, backward_fused, backward_input, backward_weight
from fastpipe.runtime.chain import Chain


def _stage(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
          for _ in range(blocks)]
    )


def measure(rows: int, width: int, blocks: int, repeats: int,
            input_grad: bool = True, fused: bool = False, chain: bool = False
            ) -> tuple[float, float, float]:
    """Median seconds of (B, I, W) for one microbatch through one stage;
    ``chain``: I and W of the stage run as a Chain, B as autograd's."""
    stage = _stage(width, blocks)
    params = list(stage.parameters())
    runner = Chain.of(stage) if chain else None
    if runner is not None and not runner.ready():
        raise RuntimeError("the benchmark stage does not run as a chain here")
    x = torch.randn(rows, width)
    b_times, i_times, w_times = [], [], []
    workspace: dict = {}  # W's reused buffers, kept per stage as the executor keeps them
    for _ in range(repeats):
        xi = x.clone().requires_grad_(input_grad)
        y = stage(xi)
        g = torch.ones_like(y)
        t0 = time.perf_counter()
        # The executor's B: fused when it can be, else the engine's own.
        if not fused or backward_fused([y], [g], [xi] if input_grad else (), params) is None:
            backward_full([y], [g])
        b_times.append(time.perf_counter() - t0)

        if runner is not None:
            y, saved = runner.forward(x)
            t0 = time.perf_counter()
            _, work = runner.backward_input(saved, g, input_grad)
            t1 = time.perf_counter()
            runner.backward_weight(work, workspace, fused)
            t2 = time.perf_counter()
        else:
            xi = x.clone().requires_grad_(input_grad)
            y = stage(xi)
            t0 = time.perf_counter()
            _, work = backward_input([y], [g], [xi], params, fused=fused)
            t1 = time.perf_counter()
            backward_weight(work, workspace=workspace)
            t2 = time.perf_counter()
        i_times.append(t1 - t0)
        w_times.append(t2 - t1)
    return statistics.median(b_times), statistics.median(i_times), statistics.median(w_times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench iw_split", description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--fused-wgrad", action="store_true",
                        help="B, I and W with fused weight gradients")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fused = ", fused weight gradients" if args.fused_wgrad else ""
    print(f"stage: {args.blocks} MLP blocks d={args.width}, microbatch of {args.rows} rows, "
          f"1 thread{fused}")
    for chain in (False, True):
        for name, input_grad in (("later stage", True), ("first stage", False)):
            b, i, w = measure(args.rows, args.width, args.blocks, args.repeats, input_grad,
                              args.fused_wgrad, chain)
            label = f"{name}{', chain' if chain else ''}"
            print(f"  {label:<19} B {b * 1e3:.2f} ms   I {i * 1e3:.2f} ms   W {w * 1e3:.2f} ms   "
                  f"(I+W)/B = {(i + w) / b:.3f}")
    return 0
