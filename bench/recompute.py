"""Selective recompute: saved-activation bytes and step time against plain layers.

For each workload, the plain ``nn.Sequential`` and the same model after
``fastpipe.selective_recompute`` run forward + backward on one microbatch;
the report gives the bytes autograd saves (parameters excluded) and the
median fwd+bwd time of each, as ratios. On CPU the layers run their torch
reference path, so the time ratio is the reference's, not the kernels'.
Liger-Kernel's layers are Triton-only; when ``liger-kernel`` is installed
the report says whether they can run here.

    python -m bench recompute [--rows N] [--width D] [--repeats N]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from bench._runner import median_time
from fastpipe.kernels import selective_recompute
from fastpipe.runtime.memory import saved_activation_bytes


class Residual(nn.Module):
    """``x + body(x)``: the pre-LN sublayer's skip connection."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def mlp_block(width: int = 64) -> nn.Sequential:
    """Linear → GELU → Linear (hidden 4 × width)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def pre_ln_mlp(width: int = 64, p: float = 0.1) -> nn.Sequential:
    """A pre-LayerNorm transformer MLP sublayer with dropout and its residual."""
    torch.manual_seed(0)
    return nn.Sequential(Residual(nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
        nn.Dropout(p),
    )))


WORKLOADS = {"linear-gelu-linear": mlp_block, "pre-ln-mlp+dropout": pre_ln_mlp}


def _liger_status() -> str:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel not installed: no Liger column"
    x = torch.randn(4, 32, requires_grad=True)
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        LigerSiLUMulFunction.apply(x, x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return f"liger-kernel installed but its kernels do not run on this device ({type(exc).__name__})"
    return "liger-kernel runs here (compare its layers by hand)"


def run(rows: int, width: int, repeats: int) -> None:
    torch.set_num_threads(1)
    print(f"selective recompute: {rows} rows x width {width}, fwd+bwd, {torch.get_num_threads()} thread")
    print(f"  {'workload':<22}{'plain KiB':>11}{'fastpipe KiB':>14}{'saved':>8}{'time ratio':>12}")
    for name, make in WORKLOADS.items():
        plain = make(width)
        ours = selective_recompute(copy.deepcopy(plain))
        x = torch.randn(rows, width, requires_grad=True)
        b_plain = saved_activation_bytes(plain, x)
        b_ours = saved_activation_bytes(ours, x)
        t_plain = median_time(lambda: plain(x).sum().backward(), 3, repeats, lambda: None)
        t_ours = median_time(lambda: ours(x).sum().backward(), 3, repeats, lambda: None)
        print(f"  {name:<22}{b_plain / 1024:>11.1f}{b_ours / 1024:>14.1f}"
              f"{1 - b_ours / b_plain:>8.0%}{t_ours / t_plain:>12.2f}")
    print(f"  {_liger_status()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench recompute", description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    run(args.rows, args.width, args.repeats)
    return 0
