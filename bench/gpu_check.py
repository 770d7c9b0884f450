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
  pack       pack/unpack on CUDA: bit-exact round trips and wire casts equal
             to torch's for 1 to 512 tensors of odd sizes and dtypes; GB/s
             of pack (plain, and fp32 to a bf16 wire) and of unpack (bf16
             wire back to fp32) for 1, 8, 64 and 512 tensors of 256 MiB in
             all, against one device copy of the same bytes and against
             torch._foreach_copy_ into views of one buffer, from the GPU's
             time alone (checked: >= 0.85 of the copy and >= 1.2x
             _foreach_copy_ at 8 and 64 tensors) and with the host's time;
             the host's time per call.
  gpt        the GPT workload (tests.models.gpt, bf16 autocast) on 2 local
             ranks on cuda:0, gpu-bound (~100M parameters, 2,048 tokens a
             microbatch) and launch-bound: each schedule's step time against
             the same microbatches run sequentially (checked: <= 1.0 and
             <= 1.05), peak memory (checked: zbv <= 1.1 x 1f1b; zbv lean,
             build(lean=True), and zbv lean/bytes, the lean cap in bytes
             as fastpipe.plan orders and splits it from a profile on the
             device, reported beside), gradients
             of 1f1b and zbv against the sequential model's, and (I+W)/B of
             two blocks (checked: <= 1.05).
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
  syncs      no host synchronisation inside a step (1f1b, zb-h2, zbv; a
             GPT on 2 ranks of cuda:0 fed host tensors, bf16 autocast):
             torch's sync debug mode counts none.
  rebuild    Pipes built, stepped and dropped over one model on cuda:0 (1f1b,
             zbv, gpipe; a failed step, then a new Pipe; SGD steps between):
             every step's gradients against the unsplit model's, for a GPT
             (fp64) and, where transformers is importable, a Hugging Face
             GPT-2 cut into layers (fp32, against its own forward); the
             streams are reused (bench/_lifecycle.py).
  soak       200 AdamW steps of a GPT under bf16 autocast, 1f1b and zbv on
             cuda:0: the loss goes down; live and reserved GPU memory and
             the host heap flat after warm-up.

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

from bench._runner import median_time, round_robin_medians, switched

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
    ``device_only`` queues a spin kernel first (2 ms, or three times the
    host's time per call if longer), so the host has queued everything
    before the GPU reaches the start event: the GPU's own time.
    """
    if DEV != "cuda":
        return _wall_time(fn, 1, 3)
    hosts = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    host = statistics.median(hosts)  # not the first call's one-off costs (a kernel's compile)
    # ~2 GHz (an H200's 1.98): at least 2 ms, at most 100 ms of spin a call.
    cycles = int(min(max(4_000_000, 3 * host * 2e9), 200_000_000)) if device_only else 0
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
    # torch runs work on these: streams that are never destroyed (runtime/streams.py).
    a, b = C.process_cuda_stream(0, -1), C.process_cuda_stream(0, 0)
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
    lanes.close()


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


def _odd_tensors(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` tensors of odd sizes and mixed dtypes, with values past fp8's
    range; every fourth a strided view, every fifth one element off a 16-byte
    boundary (both made on the device, where the kernel reads them)."""
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.float64)
    out = []
    for i in range(n):
        size = int(torch.randint(0, 700 if n > 8 else 9000, (), generator=g))
        dtype = dtypes[i % len(dtypes)]
        t = ((torch.randn(size + 1, generator=g, dtype=torch.float64) * 300).to(dtype)).to(DEV)
        t = t[1:] if i % 5 == 4 else t[:size]
        if i % 4 == 3 and size >= 6:
            t = t[: size // 2 * 2].view(2, -1).t()
        out.append(t)
    return out


def _reference(t: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """What ``t`` should come back as: torch's cast on the CPU, saturating
    fp8 at ±448 as torch does from 2.13 on (earlier torch gives NaN from 480),
    for the dtypes the kernels cast; for fp64, which its slots leave to
    torch's cast on the device, that cast."""
    from fastpipe.runtime.packing import wire_roundtrip

    if t.dtype == torch.float64:
        return wire_roundtrip(t, wire).cpu()
    if wire == torch.float8_e4m3fn and t.is_floating_point():
        t = t.clamp(-448, 448)
    return wire_roundtrip(t.cpu(), wire)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits, except that any NaN equals any NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a[~nan].view(_BITS[a.element_size()]), b[~nan].view(_BITS[b.element_size()])
    return torch.equal(a, b)


def _pack_checks() -> None:
    """Bit-exact round trips and casts equal to ``_reference``'s, on the
    kernels (in the interpreter in a rehearsal)."""
    from fastpipe import pack, unpack
    from fastpipe.kernels import backend

    torch.manual_seed(0)
    with backend("triton"):
        mixed = [torch.randn(3, 5, device=DEV), torch.arange(7, device=DEV),
                 torch.rand(4, device=DEV) > 0.5, torch.randn(0, 3, device=DEV),
                 torch.randn(6, 4, device=DEV).t(), torch.randn(9, device=DEV, dtype=torch.bfloat16),
                 torch.randn(5, device=DEV, dtype=torch.float16)]
        flat, layout = pack(mixed)
        back = unpack(flat, layout)
        check("pack/unpack round trip is bit-exact", all(_same(a, b) for a, b in zip(mixed, back)))
        for wire in (torch.bfloat16, torch.float8_e4m3fn):
            src = [torch.randn(1000, device=DEV) * 100, torch.randn(33, device=DEV, dtype=torch.float16),
                   torch.arange(5, device=DEV)]
            flat, layout = pack(src, wire_dtype=wire)
            back = unpack(flat, layout)
            check(f"wire {str(wire).split('.')[-1]} equals torch's cast",
                  all(_same(_reference(t, wire), b.cpu()) for t, b in zip(src, back)))
        for n in (1, 7, 64, 131) if SMALL else (1, 7, 64, 131, 512):
            tensors = _odd_tensors(n, n)
            wrong = []
            for wire in (None, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
                flat, layout = pack(tensors, wire_dtype=wire)
                if not all(_same(_reference(t, wire), b.cpu()) for t, b in zip(tensors, unpack(flat, layout))):
                    wrong.append(str(wire).split(".")[-1])
            check(f"{n} tensors of odd sizes and dtypes: round trip and casts equal torch's", not wrong,
                  f"wrong with wire {wrong}" if wrong else "")


def _rates(label: str, n: int, ours, theirs, traffic: int, copy_rate: float) -> None:
    """Figures for one operation: GB/s, share of the copy's bandwidth and
    speed against ``_foreach_copy_``, from the GPU's time alone (the host's
    work queued behind a spin kernel) and with the host's time (an idle
    stream at the start event); on a GPU, PASS/FAIL of the GPU's time against
    the targets for 8 and 64 tensors."""
    t_ours, t_each = _cuda_time(ours, device_only=True), _cuda_time(theirs, device_only=True)
    h_ours, h_each = _cuda_time(ours), _cuda_time(theirs)
    share, speed = traffic / t_ours / copy_rate, t_each / t_ours
    figure(f"{label} {n} tensors: share of copy bandwidth", share, "",
           f"{traffic / t_ours / 1e9:.0f} GB/s, _foreach_copy_ {traffic / t_each / 1e9:.0f} GB/s; with the "
           f"host's time {traffic / h_ours / copy_rate:.2f}, _foreach_copy_ {traffic / h_each / copy_rate:.2f}")
    figure(f"{label} {n} tensors: speed vs _foreach_copy_", speed, "x", f"with the host's time {h_each / h_ours:.2f}x")
    figure(f"{label} {n} tensors: host time per call", _host_time(ours) * 1e6, " us",
           f"_foreach_copy_ {_host_time(theirs) * 1e6:.0f} us")
    if DEV == "cuda" and n in (8, 64):
        check(f"{label} {n} tensors: >= 0.85 of copy bandwidth", share >= 0.85, f"{share:.2f}")
        check(f"{label} {n} tensors: >= 1.2x _foreach_copy_", speed >= 1.2, f"{speed:.2f}x")


def section_pack() -> None:
    from fastpipe import pack, unpack
    from fastpipe.runtime.packing import _views

    _pack_checks()
    # Bandwidth, from CUDA events around each call.
    total = (1 << 20) if SMALL else (256 << 20)
    src_one = torch.randn(total // 2, device=DEV, dtype=torch.bfloat16)
    dst_one = torch.empty_like(src_one)
    copy_rate = 2 * total / _cuda_time(lambda: dst_one.copy_(src_one), device_only=True)
    figure("device copy bandwidth (read+write)", copy_rate / 1e9, " GB/s", f"{total >> 20} MiB copy_")
    del src_one, dst_one
    for n in (1, 8, 64, 512):
        # Plain: bf16 tensors into one buffer (unpacking them is views).
        tensors = list(torch.randn(total // 2, device=DEV, dtype=torch.bfloat16).chunk(n))
        flat, layout = pack(tensors)
        views = unpack(flat, layout)
        _rates("pack", n, lambda: pack(tensors, out=flat), lambda: torch._foreach_copy_(views, tensors),
               2 * total, copy_rate)
        del tensors, flat, views
        # Cast: fp32 tensors to a bf16 wire and back (4 + 2 bytes an element moved).
        floats = list(torch.randn(total // 6, device=DEV).chunk(n))
        flat, layout = pack(floats, wire_dtype=torch.bfloat16)
        wires = _views(flat, layout)
        decoded = [torch.empty_like(t) for t in floats]
        _rates("pack to bf16 wire,", n, lambda: pack(floats, wire_dtype=torch.bfloat16, out=flat),
               lambda: torch._foreach_copy_(wires, floats), total // 6 * 6, copy_rate)
        _rates("unpack from bf16 wire,", n, lambda: unpack(flat, layout),
               lambda: torch._foreach_copy_(decoded, wires), total // 6 * 6, copy_rate)
        del floats, flat, wires, decoded


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
                    lanes = pipe._runner.device_lanes[0]
                    caller = torch.cuda.current_stream().cuda_stream
                    check(f"{schedule}: ranks have compute streams of their own and receive "
                          "into the buffer ring",
                          lanes.compute_stream.handle not in (0, caller)
                          and pipe._runner.recv_rings is not None and bool(pipe._runner.recv_rings.rings),
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

                pipe.close()
                with switched(switch_interval=str(SHORT_SWITCH_INTERVAL)):
                    pipe = Pipe(model, chunks=chunks, schedule=schedule, devices=devices, stages_per_rank=spr)
                try:
                    t_short = _wall_time(lambda: pipe.step(x, y, loss_fn))
                finally:
                    pipe.close()
                figure(f"{label} {schedule}: step time at a {SHORT_SWITCH_INTERVAL * 1e3:g} ms GIL switch "
                       "interval / at the default", t_short / t_pipe, "", f"default {sys.getswitchinterval() * 1e3:g} ms")
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
            rings = pipe._runner.recv_rings
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

    def model(seed: int = 0, device: str = DEV) -> nn.Sequential:
        torch.manual_seed(seed)
        with torch.device(device):
            layers: list[nn.Module] = [nn.Linear(5, 16)]
            for i in range(6):
                layers.append(nn.Tanh() if i % 2 else nn.Linear(16, 16))
            layers.append(nn.Linear(16, 3))
        return nn.Sequential(*layers).to(device, torch.float64)

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
    # Built on the meta device: the Pipe makes each stage's tensors on the
    # GPU, refuses to step until they are written, then trains as the model.
    for name in ("1f1b", "zbv"):
        m, x = model(device="meta"), x0.clone().requires_grad_()
        pipe = Pipe(m, chunks=chunks, schedule=name, devices=devices)
        try:
            pipe.step(x, y, loss_fn)
            refused = False
        except ValueError:
            refused = True
        pipe.load_state_dict(model().state_dict())
        loss = pipe.step(x, y, loss_fn)
        pipe.close()
        _sync()
        diff = max([abs(loss.item() - want_loss.item()), (x.grad - x_ref.grad).abs().max().item()]
                   + [(p.grad - q.grad).abs().max().item() for p, q in zip(m.parameters(), ref.parameters())])
        on = {p.device.type for p in m.parameters()}
        check(f"{name} built on meta: made on {sorted(on)}, refused until loaded, then the unsplit "
              "model's gradients", refused and on == {torch.device(DEV).type} and diff < 1e-10,
              f"refused {refused}, max abs diff {diff:.1e}")


# --- syncs ------------------------------------------------------------------------

def section_syncs() -> None:
    """No host synchronisation inside a step: the host queues a step's work
    ahead of the GPU (what launch-bound sizes live on). A GPT on two ranks of
    cuda:0, its batch and targets on the host as a DataLoader gives them,
    bf16 autocast; after a warm-up step, a step under torch's sync debug
    mode, whose warnings are counted (any rank's thread)."""
    import warnings

    from fastpipe import Pipe
    from tests.models import gpt, gpt_batch, lm_loss

    devices = [DEV, DEV] if DEV == "cpu" else ["cuda:0", "cuda:0"]
    sizes = dict(vocab=64, d=32, heads=2, blocks=4, seq=16)
    ids, tg = gpt_batch(16, sizes["vocab"], sizes["seq"])  # on the host
    for schedule in ("1f1b", "zb-h2", "zbv"):
        model = gpt(dtype=torch.float32, **sizes).to(DEV)
        pipe = Pipe(model, chunks=4, schedule=schedule, devices=devices,
                    stages_per_rank=2 if schedule == "zbv" else None)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            for _ in range(3):  # the third step runs the order the second one measured
                pipe.step(ids, tg, lm_loss)
            _sync()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    pipe.step(ids, tg, lm_loss)
                finally:
                    if DEV == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
        _sync()
        pipe.close()
        syncs = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
        check(f"{schedule}: a step from host tensors synchronizes the host with the GPU nowhere",
              not syncs, f"{len(syncs)} synchronizing calls" + (f", first: {syncs[0]}" if syncs else ""))


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


# --- rebuild, soak ------------------------------------------------------------------


# --- gpt ---------------------------------------------------------------------------

# name: (GPT sizes, batch, microbatches), bf16 autocast. gpu-bound: ~100M
# parameters, 2,048 tokens a microbatch; launch-bound: small matrices, so
# kernel launches and the host's Python set the pace.
GPT_SHAPES = {
    "gpu-bound": (dict(vocab=32000, d=768, heads=12, blocks=10, seq=1024), 16, 8),
    "launch-bound": (dict(vocab=8192, d=256, heads=4, blocks=10, seq=256), 16, 8),
}
GPT_SHAPES_SMALL = {"gpu-bound": (dict(vocab=1024, d=32, heads=2, blocks=4, seq=16), 8, 4)}
GPT_TARGET = {"gpu-bound": 1.0, "launch-bound": 1.05}
# "zbv lean": build("zbv", lean=True), no microbatch waiting for its W past the in-flight count;
# "zbv lean/bytes": that cap in bytes, the order and split fastpipe.plan gives it from a
# profile on the device (Candidate.sized), where its walk is below the others'.
GPT_SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "zbv lean", "zbv lean/bytes", "dualpipev"]


def _sized_lean(model, ids, targets, loss_fn, chunks: int, amp):
    """``fastpipe.plan``'s zbv candidate whose lean cap counts bytes, profiled
    on the device under ``amp`` with the loss; None where the planner made none."""
    from fastpipe import plan

    with amp:
        found = plan(model, ids, 2, schedules=["zbv"], chunks=[chunks], checkpoints=["never"],
                     device=DEV, loss_fn=loss_fn, target=targets)
    return next((c for c in found.candidates if c.sized), None)


def section_gpt() -> None:
    """The GPT workload (tests.models.gpt) on two local ranks on one device,
    bf16 autocast, split by ``balance="auto"``: each schedule's step time
    against the same microbatches run sequentially on one stream (in turns),
    its peak memory, gradients against the sequential model's in fp32; and
    (I+W)/B of one block pair."""
    from bench.iw_split import measure
    from fastpipe import Pipe
    from fastpipe.schedules import build
    from tests.models import Block, gpt, gpt_batch, lm_loss

    devices = [DEV, DEV] if DEV == "cpu" else ["cuda:0", "cuda:0"]
    amp = torch.autocast(DEV, dtype=torch.bfloat16)
    for label, (sizes, batch, chunks) in (GPT_SHAPES_SMALL if SMALL else GPT_SHAPES).items():
        ids, tg = (t.to(DEV) for t in gpt_batch(batch, sizes["vocab"], sizes["seq"]))
        seq_model = gpt(dtype=torch.float32, **sizes).to(DEV)

        def sequential():
            for a, b in zip(ids.tensor_split(chunks), tg.tensor_split(chunks)):
                with amp:
                    loss = lm_loss(seq_model(a), b) / chunks
                loss.backward()

        peak = {}
        for schedule in GPT_SCHEDULES:
            try:  # a schedule that fails (out of memory, say) costs its own rows only
                name, lean = schedule.split()[0], schedule.endswith((" lean", " lean/bytes"))
                spr = 2 if name in ("zbv", "dualpipev") else None
                model = gpt(dtype=torch.float32, **sizes).to(DEV)
                # Split by measured time, which also orders a zero-bubble schedule
                # for the measured F, I and W where that simulates faster (a
                # lean one keeps its unit-cost order: it is given as a list).
                runs, split = (build(name, 2, chunks, spr, lean=True) if lean else name), "auto"
                if schedule.endswith("/bytes"):
                    sized = _sized_lean(model, ids, tg, lm_loss, chunks, amp)
                    if sized is None:
                        figure(f"gpt {label} {schedule}: not a candidate", 0.0, "",
                               "its walk is not below the count-capped lean order's")
                        continue
                    runs, split = sized.order, list(sized.balance)
                pipe = Pipe(model, chunks=chunks, schedule=runs, devices=devices, stages_per_rank=spr,
                            balance=split)

                def step():
                    with amp:
                        pipe.step(ids, tg, lm_loss)

                if schedule in ("1f1b", "zbv", "zbv lean", "zbv lean/bytes"):  # the same gradients, to bf16 rounding
                    for p in seq_model.parameters():
                        p.grad = None
                    sequential()
                    step()
                    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
                                for p, q in zip(model.parameters(), seq_model.parameters()))
                    check(f"gpt {label} {schedule}: gradients equal the sequential model's (bf16 autocast)",
                          worst < 5e-2, f"largest relative difference {worst:.1e}")
                times = round_robin_medians({"seq": sequential, "pipe": step}, warmup=2, rounds=5,
                                            sync=_sync, per_round=2)
                ratio = times["pipe"] / times["seq"]
                reordered = pipe.schedule.actions != build(name, 2, chunks, spr, lean=lean).actions
                how = "; fastpipe.plan's order and split" if split != "auto" else \
                    "; ordered by the measured costs" if reordered else ""
                figure(f"gpt {label} {schedule}: pipeline / sequential step time", ratio, "",
                       f"sequential {times['seq'] * 1e3:.1f} ms; balance {pipe.balance}{how}")
                if DEV == "cuda":
                    check(f"gpt {label} {schedule}: step time <= {GPT_TARGET[label]} x sequential",
                          ratio <= GPT_TARGET[label], f"{ratio:.3f}")
                    _sync()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    _sync()
                    peak[schedule] = torch.cuda.max_memory_allocated() - base
                    figure(f"gpt {label} {schedule}: peak memory of a step over what was live", peak[schedule] / 2**30,
                           " GiB")
                pipe.close()
                del pipe, model
            except Exception:  # noqa: BLE001 - reported, and the next schedule runs
                traceback.print_exc()
                check(f"gpt {label} {schedule}: ran", False, "raised (traceback above)")
                _sync()
        if "zbv" in peak and "1f1b" in peak:
            check(f"gpt {label}: zbv peak memory <= 1.1 x 1f1b's", peak["zbv"] <= 1.1 * peak["1f1b"],
                  f"{peak['zbv'] / peak['1f1b']:.2f}")
            for variant in ("zbv lean", "zbv lean/bytes"):
                if variant in peak:
                    figure(f"gpt {label}: {variant} peak memory / 1f1b's", peak[variant] / peak["1f1b"])
        del seq_model
        d, heads = sizes["d"], sizes["heads"]
        b, i, w = measure(lambda: nn.Sequential(Block(d, heads), Block(d, heads)),
                          (batch // chunks, sizes["seq"], d), 5 if SMALL else 20, DEV, bf16=True)
        figure(f"gpt {label}: (I+W)/B of two blocks, bf16", (i + w) / b, "",
               f"B {b * 1e3:.2f} ms, I {i * 1e3:.2f} ms, W {w * 1e3:.2f} ms")
        if DEV == "cuda":
            check(f"gpt {label}: (I+W)/B <= 1.05", (i + w) / b <= 1.05, f"{(i + w) / b:.3f}")


def section_rebuild() -> None:
    from bench._lifecycle import rebuild

    rebuild(DEV, SMALL, check, figure)


def section_soak() -> None:
    from bench._lifecycle import soak

    soak(DEV, SMALL, check, figure)


SECTIONS = {"ring": section_ring, "gpt": section_gpt, "local": section_local, "grads": section_grads, "pack": section_pack,
            "kernels": section_kernels, "recompute": section_recompute, "rebuild": section_rebuild,
            "soak": section_soak, "syncs": section_syncs}


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
