"""The device check: everything fastpipe claims about CUDA, measured on one GPU.

Run by ``bench/gpu_check.sh`` (which builds the extension first). Each
section runs on its own: one that fails prints its traceback and the rest
still run. Figures go to stdout and, with ``--out``, to a JSON file.

Sections:
  ring       fastpipe._C's CUDA backend: streams handed to torch as
             ExternalStream, events ordering work across them, host cost
             of record+wait, the copy lane (priority, a copy queued behind
             its producer's event).
  kernels    the Triton kernels (activation, gated, norm, dropout) against
             their torch reference on CUDA tensors, forward and backward.
  pack       pack/unpack on CUDA: bit-exact round trip, wire casts equal to
             torch's, bandwidth against one device copy of the same bytes
             and against torch._foreach_copy_ into views (with and without
             the host's time), host time per call.
  local      a 2-rank local pipeline with both ranks on cuda:0 against the
             same stages run sequentially (gradients equal for gpipe, 1f1b,
             zb-h1, zbv; step-time ratio on gpu-bound, host-bound and
             overhead-bound shapes; step time per action, and on empty
             stages the host overhead of one action; live GPU memory,
             caching-allocator segments and receive slots over steps in
             steady state; ring off / ring on, i.e. copies on the compute stream
             against the copy lanes; the share of the GPU's copy time that
             overlapped a kernel, from the profiler's device timeline).
  grads      every schedule, 2 ranks on cuda:0, in fp64: the step's loss,
             parameter and input gradients against the unsplit model's, plain
             and with checkpoint="always".
  recompute  selective recompute on CUDA: saved bytes and time ratio.

    python -m bench.gpu_check [--out FILE] [--sections ring,kernels,...] [--deadline S]

``--deadline S`` ends the process after S seconds with every thread's stack
printed (faulthandler), so a hang shows where it hangs.

``--device cpu`` runs every section but ``ring`` on the CPU at small sizes
(Triton in its interpreter): a rehearsal that the script itself works, not
a measurement (the test suite runs it).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
import traceback

import torch
from torch import nn

from bench._runner import median_time, round_robin_medians

RESULTS: dict = {}
DEV = "cuda"  # set by main(); "cpu" for a rehearsal
SMALL = False  # rehearsal sizes
OUT_PATH: str | None = None  # --out: rewritten after every figure and check


def _save() -> None:
    """Write what is known so far, so a section cut off by its deadline keeps its figures."""
    if OUT_PATH:
        with open(OUT_PATH, "w") as f:
            json.dump(RESULTS, f, indent=1)


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _cuda_time(fn, warmup: int = 3, repeats: int = 20, device_only: bool = False) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events around each call).

    The stream is idle when the start event is recorded, so the span also
    holds whatever host time ``fn`` spends before its GPU work is queued.
    ``device_only`` queues a 2 ms spin kernel first, so the host has queued
    everything before the GPU reaches the start event: the GPU's own time.
    """
    if DEV != "cuda":
        return _wall_time(fn, 1, 3)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    cycles = 4_000_000 if device_only else 0  # ~2 ms at an H200's 1.98 GHz
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if cycles:
            torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_time(fn, repeats: int = 20) -> float:
    """Median wall seconds of one call of ``fn`` on the host (the GPU not drained between calls)."""
    fn()
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync()
    return statistics.median(times)


def _wall_time(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall seconds of ``fn`` with the device drained before and after."""
    return median_time(fn, warmup, repeats, _sync)


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.setdefault("checks", {})[name] = bool(ok)
    print(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
    _save()


def figure(name: str, value: float, unit: str = "", note: str = "") -> None:
    RESULTS.setdefault("figures", {})[name] = value
    print(f"  {name}: {value:.4g}{unit}{'  (' + note + ')' if note else ''}")
    _save()


# --- ring -------------------------------------------------------------------------


def section_ring() -> None:
    import fastpipe._C as C

    check("extension built with the CUDA backend", C.has_cuda, C.cuda_status())
    check("CUDA runtime found at run time", C.cuda_runtime_available())
    a, b = C.CudaStream(0, -1), C.CudaStream(0, 0)
    sa = torch.cuda.ExternalStream(a.handle)
    sb = torch.cuda.ExternalStream(b.handle)
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    event = C.CudaEvent()
    with torch.cuda.stream(sa):
        y = x @ x  # long enough that an unordered reader would see garbage
        event.record(a)
    event.wait(b)
    with torch.cuda.stream(sb):
        z = y.clone()
    b.synchronize()
    torch.cuda.synchronize()  # y is final now: z must equal it if B waited for A's event
    check("event orders a consumer stream after a producer stream",
          torch.equal(z, y), "matmul on stream A, clone on stream B after A's event")
    check("events report completion", event.query())
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        event.record(a)
        event.wait(b)
    figure("host cost of one event record + stream wait", (time.perf_counter() - t0) / n * 1e6, " us")
    _sync()

    # The copy lane: cudaMemcpyPeerAsync regions on a stream, after an event.
    from fastpipe.runtime.lanes import CudaLanes

    lanes = CudaLanes(torch.device("cuda:0"))
    least, greatest = C.cuda_priority_range(0)
    check("copy lane has the device's highest priority", lanes.copy_stream.priority == greatest,
          f"range [{greatest}, {least}], copy {lanes.copy_stream.priority}")
    with lanes.compute():
        src = x @ x  # the producer, still running when the copy is queued
        ready = lanes.record()
    dst = torch.empty(src.numel() * 4 + 64, dtype=torch.uint8, device="cuda")
    done = lanes.copy(dst, [(src, 64)], after=[ready])
    lanes.synchronize(done)
    torch.cuda.synchronize()
    back = dst[64:].view(torch.float32).view(src.shape)
    check("copy lane copies after the producer's event", torch.equal(back, src))


# --- kernels ----------------------------------------------------------------------


def section_kernels() -> None:
    from fastpipe.kernels import ActLinear, GeGLU, LayerNorm, RMSNorm, SeededDropout, SwiGLU, backend

    torch.manual_seed(0)
    cases = {
        "ActLinear(gelu)": lambda: ActLinear("gelu", 256, 512),
        "SwiGLU": lambda: SwiGLU(),
        "GeGLU": lambda: GeGLU(),
        "LayerNorm": lambda: LayerNorm(512),
        "RMSNorm": lambda: RMSNorm(512),
        "SeededDropout(0.1)": lambda: SeededDropout(0.1),
    }
    for name, make in cases.items():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            torch.manual_seed(1)
            module = make().to(DEV, dtype)
            width = 256 if name.startswith("ActLinear") else 512
            x = torch.randn(64, width, device=DEV, dtype=dtype, requires_grad=True)
            outs = {}
            for impl in ("torch", "triton"):
                x.grad = None
                for p in module.parameters():
                    p.grad = None
                torch.manual_seed(2)  # same dropout seed draw for both
                with backend(impl):
                    y = module(x)
                    y.float().square().sum().backward()
                outs[impl] = (y.detach().float(), x.grad.float(),
                              [p.grad.float() for p in module.parameters()])
            (y0, g0, p0), (y1, g1, p1) = outs["torch"], outs["triton"]
            err = max([(y0 - y1).abs().max().item(), (g0 - g1).abs().max().item()]
                      + [(a - b).abs().max().item() for a, b in zip(p0, p1)])
            scale = max(1.0, y0.abs().max().item(), g0.abs().max().item())
            check(f"{name} {str(dtype).split('.')[-1]} triton == torch reference",
                  err <= tol * scale * 10, f"max abs diff {err:.2e}")


# --- pack -------------------------------------------------------------------------


def section_pack() -> None:
    from fastpipe import pack, unpack

    torch.manual_seed(0)
    mixed = [torch.randn(3, 5, device=DEV), torch.arange(7, device=DEV),
             torch.rand(4, device=DEV) > 0.5, torch.randn(0, 3, device=DEV),
             torch.randn(6, 4, device=DEV).t(), torch.randn(9, device=DEV, dtype=torch.bfloat16),
             torch.randn(5, device=DEV, dtype=torch.float16)]
    flat, layout = pack(mixed)
    back = unpack(flat, layout)
    check("pack/unpack round trip is bit-exact",
          all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(mixed, back)))
    for wire in (torch.bfloat16, torch.float8_e4m3fn):
        src = [torch.randn(1000, device=DEV) * 100, torch.randn(33, device=DEV, dtype=torch.float16),
               torch.arange(5, device=DEV)]
        flat, layout = pack(src, wire_dtype=wire)
        back = unpack(flat, layout)
        want = [t.to(wire).to(t.dtype) if t.is_floating_point() and t.element_size() > wire.itemsize else t
                for t in src]
        check(f"wire {str(wire).split('.')[-1]} equals torch's cast",
              all(torch.equal(a, b) for a, b in zip(back, want)))
    total = (1 << 20) if SMALL else (64 << 20)
    src_one = torch.randn(total // 4, device=DEV)
    dst_one = torch.empty_like(src_one)
    t_copy = _cuda_time(lambda: dst_one.copy_(src_one))
    figure("device copy bandwidth (read+write)", 2 * total / t_copy / 1e9, " GB/s", "64 MiB copy_")
    for n in (1, 8, 64):
        tensors = list(torch.randn(total // 4, device=DEV).chunk(n))
        flat, layout = pack(tensors)
        views = unpack(flat, layout)
        t_pack = _cuda_time(lambda: pack(tensors, out=flat))
        t_each = _cuda_time(lambda: torch._foreach_copy_(views, tensors))
        figure(f"pack {n} tensors: share of copy bandwidth", t_copy / t_pack, "",
               f"target >= 0.85; {2 * total / t_pack / 1e9:.0f} GB/s")
        figure(f"pack {n} tensors: speed vs _foreach_copy_", t_each / t_pack, "x", "target >= 1.2 for 8+")
        # The same, split: the GPU's own time (host work hidden behind a spin
        # kernel) and the host's time per call.
        t_dev = _cuda_time(lambda: pack(tensors, out=flat), device_only=True)
        t_each_dev = _cuda_time(lambda: torch._foreach_copy_(views, tensors), device_only=True)
        figure(f"pack {n} tensors: GPU time alone, share of copy bandwidth", t_copy / t_dev, "",
               f"_foreach_copy_ {t_copy / t_each_dev:.2f}")
        figure(f"pack {n} tensors: host time per call", _host_time(lambda: pack(tensors, out=flat)) * 1e6, " us",
               f"_foreach_copy_ {_host_time(lambda: torch._foreach_copy_(views, tensors)) * 1e6:.0f} us")
        halves = list(torch.randn(total // 4, device=DEV).chunk(n))
        flat16, layout16 = pack(halves, wire_dtype=torch.bfloat16)
        t_cast = _cuda_time(lambda: pack(halves, wire_dtype=torch.bfloat16, out=flat16))
        t_uncast = _cuda_time(lambda: unpack(flat16, layout16))
        figure(f"pack {n} tensors to bf16 wire", 1.5 * total / t_cast / 1e9, " GB/s",
               f"unpack back to fp32 {1.5 * total / t_uncast / 1e9:.0f} GB/s")


# --- local ------------------------------------------------------------------------


def _mlp(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(blocks)])


def _segments() -> int:
    """cudaMalloc calls so far (the caching allocator's segments)."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if DEV == "cuda" else 0


def _allocated() -> int:
    """Bytes of live tensors on the GPU (the caching allocator's count)."""
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


def _hidden_share(sim) -> float | None:
    """Share of the comm-track time that some compute record overlaps."""
    compute = sorted((r.start, r.end) for r in sim.timeline if r.track == "compute")
    comm = [(r.start, r.end) for r in sim.timeline if r.track == "comm"]
    total = sum(e - s for s, e in comm)
    if not total:
        return None
    hidden = 0.0
    for s, e in comm:
        for cs, ce in compute:
            if cs >= e:
                break
            hidden += max(0.0, min(e, ce) - max(s, cs))
    return min(1.0, hidden / total)


def _copies_hidden(step) -> float | None:
    """Share of the GPU's memcpy time during one step that overlapped a kernel
    (from the torch profiler's device timeline)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels, copies = [], []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        name = e.name.lower()
        if "memcpy" in name:
            copies.append(span)
        elif "memset" not in name:
            kernels.append(span)
    total = sum(e - s for s, e in copies)
    if not total:
        return None
    kernels.sort()
    merged: list[list[float]] = []
    for s, e in kernels:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    hidden = sum(max(0.0, min(e, ke) - max(s, ks)) for s, e in copies for ks, ke in merged)
    return hidden / total


# Local workloads: (label, width, blocks, batch, chunks). On an H200, fp32:
# gpu-bound      256-row microbatches: each GEMM ~0.2 ms, the host is idle
#                most of the time, so the pipeline's price is GPU-side only.
# host-bound     32-row microbatches of the same model: the GPU work per
#                action is about what launching it costs the host.
# overhead-bound narrow layers: nearly all host time.
# empty          width 16: the step is fastpipe's own work per action plus
#                the launch of a few tiny kernels; its per-action figure is
#                the host overhead of one action.
LOCAL_SHAPES = (("gpu-bound", 2048, 8, 2048, 8), ("host-bound", 2048, 8, 256, 8),
                ("overhead-bound", 128, 8, 64, 16), ("empty", 16, 4, 32, 8))
LOCAL_SHAPES_SMALL = (("gpu-bound", 64, 4, 16, 4), ("overhead-bound", 16, 4, 16, 8), ("empty", 8, 4, 16, 8))
LOCAL_TARGET = {"gpu-bound": "one GPU: target <= 1.05", "host-bound": "one GPU: target <= 1.05"}


def section_local() -> None:
    from fastpipe import Pipe

    loss_fn = nn.functional.mse_loss
    devices = [DEV, DEV] if DEV == "cpu" else ["cuda:0", "cuda:0"]
    for label, width, blocks, batch, chunks in (LOCAL_SHAPES_SMALL if SMALL else LOCAL_SHAPES):
        x = torch.randn(batch, width, device=DEV)
        y = torch.randn(batch, width, device=DEV)
        seq = _mlp(width, blocks).to(DEV)
        brief = label in ("overhead-bound", "empty")  # timings only

        def sequential():
            for a, b in zip(x.tensor_split(chunks), y.tensor_split(chunks)):
                (loss_fn(seq(a), b) / chunks).backward()

        for schedule in ("gpipe", "1f1b", "zb-h1", "zbv"):
            model = _mlp(width, blocks).to(DEV)
            spr = 2 if schedule == "zbv" else None
            pipe = Pipe(model, chunks=chunks, schedule=schedule, devices=devices, stages_per_rank=spr)
            if label == "gpu-bound":
                for p in seq.parameters():
                    p.grad = None
                sequential()
                pipe.step(x, y, loss_fn)
                diff = max((p.grad - q.grad).abs().max().item()
                           for p, q in zip(model.parameters(), seq.parameters()))
                scale = max(q.grad.abs().max().item() for q in seq.parameters())
                check(f"{schedule}: 2-rank local pipeline on one device reproduces the sequential "
                      "gradients", diff <= 1e-5 * scale, f"max abs diff {diff:.1e}, largest gradient {scale:.1e}")
                if DEV == "cuda":
                    lanes = pipe._device_lanes[0]
                    caller = torch.cuda.current_stream().cuda_stream
                    check(f"{schedule}: ranks have compute streams of their own and receive "
                          "into the buffer ring",
                          lanes.compute_stream.handle not in (0, caller)
                          and pipe._recv_rings is not None and bool(pipe._recv_rings.rings),
                          f"compute stream {lanes.compute_stream.handle:#x}, caller's {caller:#x}")
            # In turns, so a slow spell of the machine falls on both.
            times = round_robin_medians({"seq": sequential, "pipe": lambda: pipe.step(x, y, loss_fn)},
                                        warmup=2, rounds=5, sync=_sync, per_round=2)
            t_seq, t_pipe = times["seq"], times["pipe"]
            per_rank = [len(a) for a in pipe._lowered.actions]
            figure(f"{label} {schedule}: pipeline / sequential step time", t_pipe / t_seq, "",
                   LOCAL_TARGET.get(label, "one GPU"))
            figure(f"{label} {schedule}: step time per action of the busiest rank",
                   t_pipe / max(per_rank) * 1e6, " us", f"{per_rank} actions per rank")
            if label == "empty":
                # Both ranks' threads share the GIL: the step's extra wall time
                # over the sequential loop, spread over every action, is what
                # fastpipe's dispatch, waits and hand-offs cost the host.
                figure(f"{label} {schedule}: host overhead per action", (t_pipe - t_seq) / sum(per_rank) * 1e6,
                       " us", "(pipeline step - sequential loop) / actions")
            if brief:
                # A lead (runtime/threads.py): the ranks' threads hand the GIL
                # to each other; the step with a shorter switch interval.
                from fastpipe.runtime.threads import SHORT_SWITCH_INTERVAL

                pipe._switch_interval = SHORT_SWITCH_INTERVAL
                try:
                    t_short = _wall_time(lambda: pipe.step(x, y, loss_fn))
                finally:
                    pipe._switch_interval = None
                figure(f"{label} {schedule}: step time at a {SHORT_SWITCH_INTERVAL * 1e3:g} ms GIL switch "
                       "interval / at the default", t_short / t_pipe, "", f"default {sys.getswitchinterval() * 1e3:g} ms")
                pipe.close()
                continue
            if DEV == "cuda":
                # Ring off: each rank's copies queue on its compute stream.
                off = Pipe(_mlp(width, blocks).to(DEV), chunks=chunks, schedule=schedule,
                           devices=devices, stages_per_rank=spr, overlap=False)
                t_off = _wall_time(lambda: off.step(x, y, loss_fn))
                figure(f"{label} {schedule}: ring off / ring on step time", t_off / t_pipe, "",
                       "copy lanes against copies on the compute stream")
                off.close()
                hidden = _copies_hidden(lambda: pipe.step(x, y, loss_fn))
                if hidden is not None:
                    figure(f"{label} {schedule}: copy time on the GPU hidden behind kernels", hidden, "",
                           "torch profiler, device timeline")
            rings = pipe._recv_rings
            slots_before = {k: (r.size, r.allocations) for k, r in rings.rings.items()} if rings else {}
            before, live = _segments(), []
            for _ in range(10):
                pipe.step(x, y, loss_fn)
                _sync()
                live.append(_allocated())
            grown = _segments() - before
            if rings:
                slots_after = {k: (r.size, r.allocations) for k, r in rings.rings.items()}
                check(f"{label} {schedule}: receive slots flat in steady state", slots_after == slots_before,
                      f"{sum(n for n, _ in slots_after.values())} slots")
            # A leak grows live bytes step after step; the two ranks' threads
            # interleave differently each step, so what is still referenced
            # when the step returns may wobble without growing.
            check(f"{label} {schedule}: live GPU memory does not grow over 10 steps",
                  max(live[5:]) <= max(live[:5]),
                  "MiB after each step: " + " ".join(f"{b / 2**20:.0f}" for b in live))
            figure(f"{label} {schedule}: new allocator segments over 10 steps", grown)
            _, sim = pipe.step_with_timeline(x, y, loss_fn)
            share = _hidden_share(sim)
            if share is not None:
                figure(f"{label} {schedule}: transfer time hidden behind compute", share, "")
            pipe.close()


# --- grads ------------------------------------------------------------------------


def section_grads() -> None:
    from fastpipe import Pipe
    from fastpipe.schedules import names

    def model(seed: int = 0) -> nn.Sequential:
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(5, 16)]
        for i in range(6):
            layers.append(nn.Tanh() if i % 2 else nn.Linear(16, 16))
        layers.append(nn.Linear(16, 3))
        return nn.Sequential(*layers).to(DEV, torch.float64)

    devices = [DEV, DEV] if DEV == "cpu" else ["cuda:0", "cuda:0"]
    loss_fn = nn.functional.mse_loss
    chunks = 4
    torch.manual_seed(1)
    x0 = torch.randn(16, 5, device=DEV, dtype=torch.float64)
    y = torch.randn(16, 3, device=DEV, dtype=torch.float64)
    ref, x_ref = model(), x0.clone().requires_grad_()
    want_loss = sum(loss_fn(ref(a), b) for a, b in zip(x_ref.tensor_split(chunks), y.tensor_split(chunks))) / chunks
    want_loss.backward()
    for name in names():
        for checkpoint in ("never", "always"):
            m, x = model(), x0.clone().requires_grad_()
            pipe = Pipe(m, chunks=chunks, schedule=name, devices=devices, checkpoint=checkpoint)
            loss = pipe.step(x, y, loss_fn)
            pipe.close()
            _sync()
            diff = max([abs(loss.item() - want_loss.item()), (x.grad - x_ref.grad).abs().max().item()]
                       + [(p.grad - q.grad).abs().max().item() for p, q in zip(m.parameters(), ref.parameters())])
            check(f"{name} checkpoint={checkpoint}: loss and gradients equal the unsplit model's",
                  diff < 1e-10, f"max abs diff {diff:.1e}")


# --- recompute --------------------------------------------------------------------


def section_recompute() -> None:
    import copy

    from bench.recompute import WORKLOADS
    from fastpipe.kernels import selective_recompute
    from fastpipe.runtime.memory import saved_activation_bytes

    for name, make in WORKLOADS.items():
        width, rows = (32, 16) if SMALL else (1024, 4096)
        plain = make(width).to(DEV)
        ours = selective_recompute(copy.deepcopy(plain))
        x = torch.randn(rows, width, device=DEV, requires_grad=True)
        b_plain, b_ours = saved_activation_bytes(plain, x), saved_activation_bytes(ours, x)
        t_plain = _cuda_time(lambda: plain(x).sum().backward())
        t_ours = _cuda_time(lambda: ours(x).sum().backward())
        figure(f"recompute {name}: saved bytes", b_ours / b_plain, "x plain")
        figure(f"recompute {name}: fwd+bwd time", t_ours / t_plain, "x plain")


SECTIONS = {"ring": section_ring, "local": section_local, "grads": section_grads, "pack": section_pack,
            "kernels": section_kernels, "recompute": section_recompute}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--out", default=None, help="write the figures and checks here as JSON")
    parser.add_argument("--sections", default=None, help="comma-separated; default: all")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a small rehearsal of the script (no ring section)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which every thread's stack is printed and the process ends")
    args = parser.parse_args(argv)
    if args.deadline is not None:
        faulthandler.dump_traceback_later(args.deadline, exit=True)
    global DEV, SMALL, OUT_PATH
    DEV, SMALL, OUT_PATH = args.device, args.device == "cpu", args.out
    names = args.sections.split(",") if args.sections else [n for n in SECTIONS if DEV == "cuda" or n != "ring"]
    if unknown := [n for n in names if n not in SECTIONS]:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to check")
        return 2
    if DEV == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module loads
    print(f"torch {torch.__version__}, " + (torch.cuda.get_device_name(0) if DEV == "cuda" else "CPU rehearsal"))
    failed = []
    for name in names:
        print(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            SECTIONS[name]()
        except Exception:  # noqa: BLE001 - report and go on to the next section
            traceback.print_exc()
            failed.append(name)
        print(f"  ({time.perf_counter() - t0:.1f} s)")
    RESULTS["sections_failed"] = failed
    bad = [k for k, ok in RESULTS.get("checks", {}).items() if not ok]
    print(f"\nsections failed: {failed or 'none'}; checks failed: {bad or 'none'}")
    _save()
    return 1 if failed or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
