"""Send-buffer packing: pack + unpack throughput, and packed vs unpacked pipeline steps.

1. Throughput (one process, one thread): 4 MiB of fp32 split into 1, 8 or 64
   tensors, packed and unpacked by ``fastpipe.pack``/``unpack``, against
   ``torch.cat`` + ``split`` and ``torch._foreach_copy_`` into views of one
   buffer; each as a ratio to one ``copy_`` of the same bytes (a memcpy).
2. A 2-rank gloo pipeline step (1F1B) whose stage boundary carries five
   tensors: fastpipe's packed message against the same executor sending one
   message per tensor (``UnpackedTransport`` below, the way per-tensor
   libraries do it), as a step-time ratio.

    python -m bench packing [--repeats N]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from torch import nn

from bench._runner import median_time, round_robin_medians, spawn
from fastpipe import pack, unpack
from fastpipe.runtime.transport.base import describe
from fastpipe.runtime.transport.dist import DistTransport

TOTAL = 4 << 20  # bytes per throughput case


def _throughput(repeats: int) -> None:
    torch.set_num_threads(1)
    print(f"pack + unpack of {TOTAL >> 20} MiB fp32 (one thread); times relative to one memcpy:")
    print(f"  {'tensors':>8}{'memcpy us':>11}{'fastpipe':>10}{'cat+split':>11}{'foreach':>9}")
    src_one = torch.randn(TOTAL // 4)
    dst_one = torch.empty_like(src_one)
    memcpy = median_time(lambda: dst_one.copy_(src_one), 5, repeats, lambda: None)
    for n in (1, 8, 64):
        tensors = list(torch.randn(TOTAL // 4).chunk(n))
        shapes = [t.numel() for t in tensors]
        flat, layout = pack(tensors)
        views = unpack(flat, layout)

        def ours():
            f, lay = pack(tensors, out=flat)
            unpack(f, lay)

        def cat_split():
            torch.cat(tensors).split(shapes)

        def foreach():
            torch._foreach_copy_(views, tensors)

        t_ours = median_time(ours, 5, repeats, lambda: None)
        t_cat = median_time(cat_split, 5, repeats, lambda: None)
        t_each = median_time(foreach, 5, repeats, lambda: None)
        print(f"  {n:>8}{memcpy * 1e6:>11.0f}{t_ours / memcpy:>10.2f}{t_cat / memcpy:>11.2f}"
              f"{t_each / memcpy:>9.2f}")


def _tag(transport: DistTransport, key, i: int) -> int:
    """Per-tensor tags, apart from the packed messages' tags."""
    return (1 << 24) + transport.tag(key) * 8 + i


class UnpackedTransport(DistTransport):
    """The same executor, one isend/irecv per tensor from the second step on.

    The first step goes packed and records each stream's tensors (shapes,
    dtypes, grad flags, structure); later steps send each tensor as its own
    message into a preallocated tensor, as per-tensor libraries do after
    their shape handshake.
    """

    _steps = 0

    def begin(self, actions):
        super().begin(actions)
        self._steps += 1
        if not hasattr(self, "_layouts"):
            self._layouts, self._specs = {}, {}

    def _unpacked(self, key) -> bool:
        return self._steps > 1 and key[:2] in self._layouts

    def _issue(self, tensors, spec, dst, key):
        if not self._unpacked(key):
            self._layouts[key[:2]] = [
                {"shape": t.shape, "dtype": t.dtype, "grad": t.requires_grad} for t in tensors
            ]
            return super()._issue(tensors, spec, dst, key)
        peer = self.peer(dst)
        return [(dist.isend(t.detach().contiguous(), dst=peer, group=self._group(key), tag=_tag(self, key, i)),
                 t, None, -1, dst) for i, t in enumerate(tensors)]

    def _post(self, src, key):
        if not self._unpacked(key):
            return super()._post(src, key)
        layout = self._layouts[key[:2]]
        bufs = [torch.empty(spec["shape"], dtype=spec["dtype"]) for spec in layout]
        works = [dist.irecv(b, src=self.peer(src), group=self._group(key), tag=_tag(self, key, i))
                 for i, b in enumerate(bufs)]
        return (works, bufs, layout)

    def _complete(self, posted, src, key):
        if not isinstance(posted, tuple):
            tensors, spec, held = super()._complete(posted, src, key)
            self._layouts[key[:2]] = [
                {"shape": t.shape, "dtype": t.dtype, "grad": t.requires_grad} for t in tensors
            ]
            self._specs[key[:2]] = spec
            return tensors, spec, held
        works, bufs, layout = posted
        for w in works:
            self._wait(w, describe(key))
        return [b.requires_grad_(s["grad"]) for b, s in zip(bufs, layout)], self._specs[key[:2]], None


class FiveOut(nn.Module):
    def forward(self, x):
        return x, x * 0.5, x.tanh(), x.sigmoid(), x * x


class FiveIn(nn.Module):
    def forward(self, v):
        a, b, c, d, e = v
        return a + b + c + d + e


def _five_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), FiveOut(), FiveIn(), nn.Linear(width, width))


def _rank_main(rank, world, init, queue, width, repeats):
    from fastpipe import Pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x, y = torch.randn(64, width), torch.randn(64, width)
    pipes = {}
    try:
        for name in ("packed", "unpacked"):
            pipe = Pipe(_five_model(width), chunks=16, schedule="1f1b", balance=[2, 2], overlap=False,
                        shm=False)  # the gloo path: the bench swaps in its own DistTransport
            if name == "unpacked":
                t = pipe._runner.transport_for(rank)
                pipe._runner.transport = UnpackedTransport(t.group, t.device, t.stages, t.timeout, None,
                                                         t.wire, stage_to_rank=t.stage_to_rank,
                                                         groups=t.groups)
            pipes[name] = pipe
        # In turns, so a slow spell of the machine falls on both.
        times = round_robin_medians(
            {name: functools.partial(pipe.step, x, y, nn.functional.mse_loss) for name, pipe in pipes.items()},
            3, repeats, dist.barrier, per_round=3)
        for pipe in pipes.values():
            pipe.close()
    finally:
        dist.destroy_process_group()
    queue.put((rank, times))


def _pipeline(repeats: int) -> None:
    for width in (64, 1024):
        times = spawn(2, _rank_main, width, repeats)[0]
        print(f"2-rank 1F1B step, 16 microbatches of 4 rows, five {width}-wide tensors per boundary: "
              f"packed {times['packed'] * 1e3:.1f} ms, one message per tensor "
              f"{times['unpacked'] * 1e3:.1f} ms, unpacked/packed {times['unpacked'] / times['packed']:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench packing", description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    _throughput(args.repeats)
    _pipeline(args.repeats)
    return 0
