"""``fastpipe.plan``: choose schedule × chunks × balance × checkpointing from measured costs.

    prof ──► for each schedule, chunks, checkpoint mode:
               balance = partition of the per-layer times (speeds), simulated
                         where a rank runs several stages (balance_for)
               zero-bubble: also ordered by the stage costs  ──► the faster order
               simulate the schedule with the stage costs  ──► step time, bubble
                 (as the executor runs them: B is I and a share of W, which
                 each stage's queue gathers over microbatches: _executed)
               walk each rank's actions                     ──► peak memory
               over ``memory_limit``: the nearest split that fits (_refit)
             ──► fastest candidate whose every rank fits ``memory_limit``

Memory per rank is what the executor accounts for in ``Pipe.memory_stats()``:
parameters × ``param_scale`` (2: parameter + gradient; 4 with Adam's two
states) plus the saved activations alive at once, microbatch by microbatch,
as the rank's action list holds and frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fastpipe import _microbatch as mbatch
from fastpipe.balance import Profile, partition, profile
from fastpipe.balance._partition import improve
from fastpipe.runtime.checkpoint import MODES, checkpointed
from fastpipe.schedules import Action, Kind, Schedule, Simulation, build, names, orders_by_cost
from fastpipe.schedules._greedy import peak_bytes

__all__ = ["Candidate", "Plan", "balance_for", "order_for", "order_measured", "ordered", "parse_bytes", "plan",
           "rank_memory"]


@dataclass(frozen=True)
class Candidate:
    """One point of the search, with what the simulator and the memory walk
    predict. ``order`` is the zero-bubble schedule ordered by the stage costs
    where that simulated faster than the built-in order (``ordered``), or its
    lean variant (``lean``), which ``Pipe(plan=...)`` then runs; None for the
    built-in order."""

    schedule: str
    chunks: int
    stages_per_rank: int
    balance: tuple[int, ...]
    checkpoint: str
    step_seconds: float
    bubble_ratio: float
    memory: tuple[int, ...]  # peak bytes per rank
    order: Schedule | None = field(default=None, compare=False, repr=False)
    lean: bool = False  # the order is ``build(..., lean=True)``'s: less held for W
    sized: bool = False  # lean, its cap counting each stage's bytes (``build(sizes=)``)

    def fits(self, limit: int | None) -> bool:
        return limit is None or max(self.memory) <= limit


@dataclass
class Plan:
    """The chosen candidate (``best``, whose choices are also ``plan.schedule``,
    ``.chunks``, ``.balance``, ``.stages_per_rank``, ``.checkpoint``) and every
    candidate considered, fastest first."""

    best: Candidate
    candidates: list[Candidate]
    memory_limit: int | None = None
    profile: Profile | None = field(default=None, repr=False)

    schedule = property(lambda self: self.best.schedule, doc="the chosen schedule's name")
    chunks = property(lambda self: self.best.chunks, doc="the chosen number of microbatches")
    balance = property(lambda self: list(self.best.balance), doc="the chosen layers per stage")
    stages_per_rank = property(lambda self: self.best.stages_per_rank, doc="the chosen stages per rank")
    checkpoint = property(lambda self: self.best.checkpoint, doc="the chosen checkpoint mode")

    def why_one_chunk(self) -> str | None:
        """Why the plan does not pipeline (one microbatch), or None when it does."""
        if self.best.chunks != 1:
            return None
        more = [c for c in self.candidates if c.chunks > 1 and c.fits(self.memory_limit)]
        if not more:
            return ("one chunk: no candidate with more microbatches fits the memory limit or the "
                    "batch (a batch of one row cannot be split)")
        c = more[0]
        return (f"one chunk (no pipelining): the fastest plan with more microbatches, {c.schedule} "
                f"with {c.chunks}, simulates {c.step_seconds * 1e3:.2f} ms against "
                f"{self.best.step_seconds * 1e3:.2f} ms: at this size each microbatch's fixed costs "
                "(launches, transfers) outweigh the bubble it would fill; a larger batch or model "
                "changes that")

    def pipe_kwargs(self) -> dict:
        """Arguments for ``Pipe`` (what ``Pipe(model, plan=...)`` uses)."""
        b = self.best
        schedule = b.order if b.order is not None else b.schedule
        return {"chunks": b.chunks, "schedule": schedule, "balance": list(b.balance),
                "stages_per_rank": b.stages_per_rank, "checkpoint": b.checkpoint}

    def explain(self, top: int = 10) -> str:
        """Prints (and returns) the ``top`` candidates as a table."""
        rows = [f"{'':2}{'schedule':<18}{'chunks':>7}{'ckpt':>12}{'step ms':>10}{'bubble':>8}"
                f"{'peak per rank':>22}  balance"]
        for c in self.candidates[:top]:
            mark = "*" if c == self.best else " " if c.fits(self.memory_limit) else "x"
            mem = " / ".join(format_bytes(m) for m in c.memory)
            name = c.schedule + (" lean/bytes" if c.sized else " lean" if c.lean
                                 else "~" if c.order is not None else "")
            rows.append(f"{mark:2}{name:<18}{c.chunks:>7}{c.checkpoint:>12}"
                        f"{c.step_seconds * 1e3:>10.2f}{c.bubble_ratio:>8.3f}{mem:>22}  {list(c.balance)}")
        limit = "none" if self.memory_limit is None else format_bytes(self.memory_limit)
        rows.append(f"  (* chosen, x over the memory limit: {limit}; ~ ordered by the measured "
                    f"costs; lean: the F-to-W cap at the F-to-I cap, /bytes: in bytes; "
                    f"{len(self.candidates)} candidates)")
        if self.why_one_chunk() is not None:
            rows.append(f"  {self.why_one_chunk()}")
        text = "\n".join(rows)
        print(text)
        return text


def _chunk_options(batch: int, ranks: int) -> list[int]:
    options = {c for c in range(1, min(batch, 64) + 1) if batch % c == 0}
    options |= {2**k for k in range(7) if 2**k <= batch}
    return sorted(c for c in options if c >= 1)


def _stage_sums(prof: Profile, balance: Sequence[int]) -> dict[str, list[float]]:
    """Per stage: the profile's sums of its layers' times (one microbatch)
    and bytes, and what its W queue gathers (``rows``, ``limit``), with the
    part of W's time that does not grow with rows (``W fixed``, from the
    profile's two-size fit; 0 without one): what gathering saves. No B: the
    executor's B is I and W (``_executed``), not autograd's backward."""
    sums = {"F": [], "I": [], "W": [], "W fixed": [], "act": [], "param": [],
            "input": [], "weight": [], "rows": [], "limit": []}
    start = 0
    for n in balance:
        layers = prof.layers[start : start + n]
        sums["F"].append(sum(x.forward for x in layers))
        sums["I"].append(sum(x.input_backward for x in layers))
        sums["W"].append(sum(x.weight_backward for x in layers))
        fixed = sum(f["weight_backward"][0] for f in prof.fits[start : start + n]) if prof.fits else 0.0
        sums["W fixed"].append(min(max(fixed, 0.0), sums["W"][-1]))
        # A tensor two neighbours save is one within a stage; at its first
        # layer it is a received copy of its own.
        sums["act"].append(sum(x.activation_bytes for x in layers)
                           - sum(x.shared_bytes for x in layers[1:]))
        sums["weight"].append(sum(x.weight_bytes for x in layers))
        # The stage's WeightQueue: the most rows of a layer, the least limit.
        sums["rows"].append(max((x.gather_rows for x in layers), default=0))
        sums["limit"].append(min((x.gather_limit for x in layers if x.gather_limit), default=0))
        sums["param"].append(sum(x.param_bytes for x in layers))
        sums["input"].append(prof.layers[start - 1].output_bytes if start else 0)
        start += n
    return sums


def stage_sizes(sums) -> list[tuple[float, float]]:
    """Per stage, what one microbatch holds from F to I and from I to W
    (``build(sizes=)``), from ``_stage_sums``."""
    return list(zip(sums["act"], sums["weight"]))


def _executed(sums, chunks: int) -> dict[str, list[float]]:
    """Per stage, what each F, I, W and B costs as the executor runs them
    (``fused_wgrad``, the default) from a profile's ``_stage_sums``: a B is
    I, then its W queued, and a W action queues it too; a stage's queue runs
    its W work once per ``g`` microbatches (the first whose rows reach its
    limit, ``deferred.WeightQueue``) and at the step's end, so each B or W
    pays its share of W: the part that grows with rows, and the fixed part
    (a pass over the weight's gradient) once per run."""
    weight = []
    for w, fixed, rows, limit in zip(sums["W"], sums["W fixed"], sums["rows"], sums["limit"]):
        g = -(-limit // rows) if rows and limit else 1  # microbatches per run of the queue
        runs = -(-chunks // max(g, 1))
        weight.append(w - fixed + fixed * runs / chunks)
    return {"F": sums["F"], "I": sums["I"], "W": weight,
            "B": [i + w for i, w in zip(sums["I"], weight)]}


def _cost_fn(sums, mode: str, chunks: int, schedule: Schedule, transfer_cost: float):
    """Per-action seconds: from a profile's ``_stage_sums`` as the executor
    runs them (``_executed``), or from measured seconds per kind and stage,
    as given (a B not given costs I + W). A checkpointed microbatch pays its
    forward again in B or I, and an action that sends to or receives from
    another rank pays ``transfer_cost`` per message on its own thread
    (packing, posting, unpacking)."""
    owner = schedule.stage_to_rank
    per_kind = _executed(sums, chunks) if "W fixed" in sums else \
        {"B": [i + w for i, w in zip(sums.get("I", ()), sums.get("W", ()))], **sums}

    def crossings(a: Action) -> int:
        if a.kind is Kind.F:
            ends = (a.stage - 1, a.stage + 1)
        elif a.kind in (Kind.B, Kind.I):
            ends = (a.stage + 1, a.stage - 1)
        else:
            return 0
        return sum(0 <= s < schedule.stages and owner[s] != owner[a.stage] for s in ends)

    def cost(a: Action) -> float:
        base = per_kind[a.kind.value][a.stage] + transfer_cost * crossings(a)
        if a.kind in (Kind.B, Kind.I) and checkpointed(mode, a.microbatch, chunks):
            base += sums["F"][a.stage]
        return base

    return cost


def balance_for(prof: Profile, schedule: Schedule, speeds: Sequence[float] | None = None,
                mode: str = "never", transfer_cost: float = 0.0, latency: float = 0.0) -> list[int]:
    """Layers per stage for ``schedule``: where each rank runs one stage, the
    split that minimises the largest stage (``partition``); where a rank runs
    several, the split whose simulated step is shortest.

    With several stages per rank neither even stages nor even ranks is the
    answer: a V puts the embedding and the head (first and last stage) on one
    rank, so even stages leave the other rank more blocks, and evening the
    ranks can make the last stage long, which the V's turn waits on. So the
    two partitions are simulated (the profile's F, I and W sums per
    stage) and the faster is improved by moving one cut a layer at a time
    while the simulated step gets shorter.

    Args:
        prof: per-layer costs at the microbatch size the schedule runs.
        schedule: the schedule the stages will run.
        speeds: per-rank speed factors.
        mode, transfer_cost, latency: as ``plan`` simulates them.
    """
    speeds = [1.0] * schedule.ranks if speeds is None else [float(v) for v in speeds]
    owners = schedule.stage_to_rank
    costs = [x.forward + x.backward for x in prof.layers]
    stage_speed = [speeds[owners[s]] for s in range(schedule.stages)]
    even = partition(costs, schedule.stages, stage_speed)
    if len(set(owners)) == schedule.stages:
        return even

    def step(bal: Sequence[int]) -> tuple[float, float]:
        cost = _cost_fn(_stage_sums(prof, bal), mode, schedule.microbatches, schedule, transfer_cost)
        sim = schedule.simulate(cost, rank_speed=speeds, latency=latency)
        return sim.makespan, max(bal)

    start = min((even, partition(costs, schedule.stages, stage_speed, owners)), key=step)
    return improve(start, step)


def ordered(schedule: Schedule, cost, speeds: Sequence[float] | None = None,
            latency: float = 0.0, lean: bool = False,
            sizes: Sequence[tuple[float, float]] | None = None) -> tuple[Schedule, Simulation]:
    """The order to run for these costs, and its simulation: for a zero-bubble
    schedule, the list scheduler's order for ``cost`` (``build(costs=)``)
    where it simulates faster than ``schedule`` with no rank holding more
    microbatches in flight; else ``schedule``.

    The built-in zero-bubble orders assume F = I = W. On transformer layers
    W is often a quarter of F, and a greedy order for the real costs is
    faster there, though not for every cost (``fastpipe.schedules._greedy``),
    hence the comparison.

    Args:
        schedule: a built schedule (its name decides whether it can be reordered).
        cost: ``(action) -> seconds``, as ``Schedule.simulate`` takes it.
        speeds: per-rank speed factors.
        latency: seconds a message takes.
        lean: ``schedule`` is a lean one (``build(lean=True)``): so is its
            order by cost.
        sizes: with ``lean``, each stage's bytes from F to I and from I to
            W (``stage_sizes``), by which ``schedule`` was built
            (``build(sizes=)``): the order by cost caps bytes alike and its
            busiest rank must hold no more of them (``_greedy.peak_bytes``),
            where without sizes no rank may hold more microbatches waiting
            for W.
    """
    speeds = [1.0] * schedule.ranks if speeds is None else list(speeds)
    sim = schedule.simulate(cost, rank_speed=speeds, latency=latency)
    if not orders_by_cost(schedule.name):
        return schedule, sim
    owner = schedule.stage_to_rank
    sizes = sizes if lean else None
    by_cost = build(schedule.name, schedule.ranks, schedule.microbatches,
                    schedule.stages // schedule.ranks,
                    costs=lambda a: cost(a) / speeds[owner[a.stage]], latency=latency, lean=lean,
                    sizes=sizes)
    other = by_cost.simulate(cost, rank_speed=speeds, latency=latency)
    # Never more in flight than the built-in order (the policy may run a
    # forward past its cap rather than stall).
    leaner = all(a <= b for a, b in zip(other.peak_inflight, sim.peak_inflight))
    if sizes is not None:  # and its busiest rank holds no more bytes than the lean order's
        leaner = leaner and max(peak_bytes(by_cost, sizes)) <= max(peak_bytes(schedule, sizes))
    elif lean:  # and no more waiting for W than the lean order given
        leaner = leaner and all(a <= b for a, b in zip(other.peak_held, sim.peak_held))
    return (by_cost, other) if other.makespan < sim.makespan and leaner else (schedule, sim)


def order_for(prof: Profile, balance: Sequence[int], schedule: Schedule, mode: str = "never",
              transfer_cost: float = 0.0) -> Schedule | None:
    """``Pipe(balance="auto")``'s order: for a built-in zero-bubble
    ``schedule`` (the order ``build`` gives for its name), the order of
    ``ordered`` for the profile's stage costs over ``balance`` where that is
    faster; None to keep ``schedule``."""
    if not orders_by_cost(schedule.name):
        return None
    built = build(schedule.name, schedule.ranks, schedule.microbatches, schedule.stages // schedule.ranks)
    if built.actions != schedule.actions or built.stage_to_rank != schedule.stage_to_rank:
        return None  # the user's own list: theirs to order
    cost = _cost_fn(_stage_sums(prof, balance), mode, schedule.microbatches, schedule, transfer_cost)
    chosen = ordered(schedule, cost)[0]
    return None if chosen is schedule else chosen


def order_measured(schedule: Schedule, seconds: dict[tuple[int, str], float]) -> Schedule | None:
    """The order a zero-bubble ``schedule`` runs in from the next step, for
    the ``seconds`` a recorded step spent in each (stage, action kind, e.g.
    ``"I"``), every rank's: ``ordered``'s choice for each kind's mean per
    action, where it simulates at least 1 % faster and no rank holds more
    microbatches in flight or waiting for their W than in ``schedule``; None
    keeps ``schedule``.

    Why from a step and not from a profile: the built-in orders assume
    F = I = W, a profile times one layer at a time, and what an action
    costs inside the pipeline (a deferred W gathered over microbatches, the
    ranks slowing each other down, an engine call's fixed cost) is only
    seen there. A W action that gathers costs little and the stage's flush
    the rest: the mean per action is what the list scheduler can use.
    """
    if not orders_by_cost(schedule.name):
        return None
    counts: dict[tuple[int, str], int] = {}
    for row in schedule.actions:
        for a in row:
            counts[(a.stage, a.kind.value)] = counts.get((a.stage, a.kind.value), 0) + 1
    mean = {k: seconds.get(k, 0.0) / n for k, n in counts.items()}

    def cost(a: Action) -> float:
        return mean.get((a.stage, a.kind.value), 0.0)

    chosen, sim = ordered(schedule, cost)
    if chosen is schedule:
        return None
    now = schedule.simulate(cost)
    held = all(a <= b for a, b in zip(sim.peak_held, now.peak_held))
    return chosen if held and sim.makespan < 0.99 * now.makespan else None


def rank_memory(schedule: Schedule, sums, mode: str, param_scale: float) -> list[int]:
    """Peak bytes per rank: parameters × ``param_scale`` + saved activations alive.

    A microbatch holds its stage's activations from F to its B, or to its I,
    and then what W reads (``LayerProfile.weight_bytes``) until its W;
    checkpointed, it holds only its input until its B/I recomputes the rest.
    From its B or W on, what W reads waits in the stage's queue while the
    rows waiting stay under the queue's limit (``deferred.WeightQueue``: B
    defers too, ``Pipe(fused_wgrad=True)``, the default).
    """
    peaks = []
    for rank, row in enumerate(schedule.actions):
        held = {s for s in range(schedule.stages) if schedule.stage_to_rank[s] == rank}
        static = sum(sums["param"][s] for s in held) * param_scale
        last = {}
        for i, a in enumerate(row):
            last[(a.stage, a.microbatch)] = i
        live = peak = 0
        alive: dict[tuple[int, int], int] = {}
        queued: dict[int, tuple[int, int]] = {}  # stage -> (rows, bytes) waiting to gather
        for i, a in enumerate(row):
            key = (a.stage, a.microbatch)
            ckpt = checkpointed(mode, a.microbatch, schedule.microbatches)
            if a.kind is Kind.F:
                add = sums["input"][a.stage] if ckpt else sums["act"][a.stage]
            elif a.kind in (Kind.B, Kind.I) and ckpt:
                add = sums["act"][a.stage]
            else:
                add = 0
            alive[key] = alive.get(key, 0) + add
            live += add
            peak = max(peak, live)
            if a.kind is Kind.I:
                live += sums["weight"][a.stage] - alive[key]
                alive[key] = sums["weight"][a.stage]
                peak = max(peak, live)
            if last[key] == i:
                live -= alive.pop(key)
            if a.kind in (Kind.B, Kind.W):
                rows, nbytes = queued.get(a.stage, (0, 0))
                add_rows, limit = sums["rows"][a.stage], sums["limit"][a.stage]
                if add_rows and rows + add_rows < limit:
                    queued[a.stage] = (rows + add_rows, nbytes + sums["weight"][a.stage])
                    live += sums["weight"][a.stage]
                    peak = max(peak, live)
                else:  # the queue runs, this microbatch's W with it
                    queued[a.stage] = (0, 0)
                    live -= nbytes
        peaks.append(int(static + peak))
    return peaks


def plan(
    model: nn.Sequential,
    sample,
    ranks: int,
    memory_limit: int | str | None = None,
    speeds: Sequence[float] | None = None,
    schedules: Sequence[str] | None = None,
    chunks: Sequence[int] | None = None,
    checkpoints: Sequence[str] = MODES,
    param_scale: float = 2.0,
    device: str | torch.device = "cpu",
    latency: float = 0.0,
    transfer_cost: float = 0.0,
    prof: Profile | None = None,
    loss_fn=None,
    target=None,
) -> Plan:
    """Searches schedule × chunks × balance × checkpoint mode with the simulator.

    Args:
        model: the ``nn.Sequential`` to pipeline.
        sample: one training batch (its size fixes the microbatch sizes).
        ranks: pipeline ranks.
        memory_limit: bytes per rank (or a string like ``"2GiB"``, ``"512MB"``);
            plans above it are rejected. Where a schedule's fastest split
            does not fit, the search also tries the splits nearby (one cut
            moved a layer at a time) for the fastest that does.
        speeds: per-rank speed factors (heterogeneous devices).
        schedules: names to consider (default: all registered).
        chunks: microbatch counts to consider (default: divisors of the batch
            up to 64 and powers of two).
        checkpoints: checkpoint modes to consider.
        param_scale: parameter copies per rank (2: parameter and gradient).
        device: where to profile.
        latency: seconds a message takes from sender to receiver.
        transfer_cost: seconds each end of a message spends on it on its
            compute thread (packing, posting, unpacking). Measure it while
            the ranks compute (``bench/plan.py``): where ranks share cores
            with the communication threads, a message sent right after
            compute costs several times what an idle ping-pong shows.
        prof: a ``Profile`` to reuse (profiling is the slow part).
        loss_fn, target: the step's loss and target batch: the last
            stage's time and memory then include the loss (a language
            model's cross-entropy saves its fp32 log-softmax, vocabulary
            wide, for every microbatch in flight on the last rank); without
            them the walk leaves it out.

    Returns:
        The ``Plan``; ``plan.explain()`` prints the candidates.

    Raises:
        ValueError: bad arguments, or no candidate fits ``memory_limit``.
    """
    limit = parse_bytes(memory_limit)
    batch = mbatch.batch_size(sample)
    options = sorted(set(chunks)) if chunks is not None else _chunk_options(batch, ranks)
    if not options or any(not isinstance(c, int) or c < 1 or c > batch for c in options):
        raise ValueError(f"chunks must be ints in [1, batch size {batch}], got {options!r}")
    speeds = [1.0] * ranks if speeds is None else [float(s) for s in speeds]
    if len(speeds) != ranks or not all(s > 0 for s in speeds):
        raise ValueError(f"speeds must hold {ranks} positive numbers, got {speeds!r}")
    unknown = [m for m in checkpoints if m not in MODES]
    if unknown:
        raise ValueError(f"unknown checkpoint modes {unknown}; valid: {list(MODES)}")
    if prof is None:
        small, large = batch // max(options), batch // min(options)
        # Each rank holds about len(model) / ranks layers: time them in runs
        # of that size, so caches see what a rank's stages put through them.
        window = -(-len(model) // ranks)
        prof = profile(model, sample, device, max(options),
                       fit_rows=large if large != small else None, window=window,
                       loss_fn=loss_fn, target=target)
    candidates = []
    for name in schedules if schedules is not None else names():
        for m in options:
            sched = build(name, ranks, m)
            if sched.stages > len(prof.layers):
                continue
            scaled = prof.scaled(batch // m)
            balance = balance_for(scaled, sched, speeds, latency=latency, transfer_cost=transfer_cost)
            # Its lean order too (no microbatch past its F-to-I cap waiting
            # for W): slower, and smaller where what W reads weighs.
            lean_sched = build(name, ranks, m, lean=True) if orders_by_cost(name) else None
            for mode in checkpoints:
                if mode == "except_last" and m == 1:
                    continue  # the same as "never"
                fast = _candidate(scaled, sched, balance, mode, False, speeds, latency,
                                  transfer_cost, param_scale)
                found = [fast]
                if lean_sched is not None:
                    lean = _candidate(scaled, lean_sched, balance, mode, True, speeds, latency,
                                      transfer_cost, param_scale)
                    if max(lean.memory) < max(fast.memory):
                        found.append(lean)
                    if mode == "never":  # (a checkpointed microbatch holds its input until I)
                        # Its cap in bytes, where that walks less still: a
                        # stage whose W reads much (a head's) runs it sooner.
                        sized = _candidate(scaled, lean_sched, balance, mode, True, speeds,
                                           latency, transfer_cost, param_scale, sized=True)
                        if max(sized.memory) < min(max(c.memory) for c in found):
                            found.append(sized)
                if limit is not None and not any(c.fits(limit) for c in found):
                    # The fastest split does not fit: the nearest one that does.
                    smallest = min(found, key=lambda c: max(c.memory))
                    refit = _refit(scaled, lean_sched if smallest.lean else sched, smallest,
                                   limit, speeds, latency, transfer_cost, param_scale)
                    if refit is not None:
                        found.append(refit)
                candidates.extend(found)
    if not candidates:
        raise ValueError(f"no schedule fits {len(prof.layers)} layers on {ranks} ranks")
    candidates.sort(key=lambda c: (not c.fits(limit), c.step_seconds, max(c.memory)))
    if not candidates[0].fits(limit):
        smallest = min(max(c.memory) for c in candidates)
        raise ValueError(
            f"no plan fits memory_limit={limit} bytes per rank; the smallest needs {smallest} bytes"
        )
    return Plan(candidates[0], candidates, limit, prof)


def _candidate(prof: Profile, sched: Schedule, balance: Sequence[int], mode: str, lean: bool,
               speeds, latency: float, transfer_cost: float, param_scale: float,
               sized: bool = False) -> Candidate:
    """``sched`` (built, or built lean) over ``balance``: its order for the
    stage costs, simulated, and its memory walk. ``sized``: the lean order
    whose cap counts the stages' bytes over ``balance`` (``build(sizes=)``)."""
    sums = _stage_sums(prof, balance)
    cost = _cost_fn(sums, mode, sched.microbatches, sched, transfer_cost)
    sizes = None
    if sized:
        sizes = stage_sizes(sums)
        sched = build(sched.name, sched.ranks, sched.microbatches, sched.stages // sched.ranks,
                      lean=True, sizes=sizes)
    chosen, sim = ordered(sched, cost, speeds, latency, lean=lean, sizes=sizes)
    memory = tuple(rank_memory(chosen, sums, mode, param_scale))
    order = chosen if lean or chosen is not sched else None
    return Candidate(sched.name, sched.microbatches, sched.stages // sched.ranks, tuple(balance),
                     mode, sim.makespan, sim.bubble_ratio, memory, order, lean=lean, sized=sized)


def _refit(prof: Profile, sched: Schedule, start: Candidate, limit: int, speeds, latency: float,
           transfer_cost: float, param_scale: float) -> Candidate | None:
    """Under ``memory_limit``: from a candidate over it, the split found by
    moving one cut a layer at a time that first brings the busiest rank's
    walk under ``limit`` and then simulates fastest; None where no move
    helps. The fastest split evens out time, not bytes (a V's first rank
    holds the embedding's and the head's stages; a stage's activations are
    not its time), so a split slightly slower can be much smaller."""
    seen: dict[tuple[int, ...], Candidate] = {}

    def score(balance: Sequence[int]) -> tuple[float, float]:
        c = seen.get(tuple(balance))
        if c is None:
            c = seen[tuple(balance)] = _candidate(prof, sched, balance, start.checkpoint, start.lean,
                                                  speeds, latency, transfer_cost, param_scale,
                                                  start.sized)
        return max(0, max(c.memory) - limit), c.step_seconds

    best = improve(list(start.balance), score)  # every split it returns was scored
    return None if tuple(best) == start.balance else seen[tuple(best)]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str | None) -> int | None:
    """``2GiB`` -> 2147483648; ints pass through; None stays None.

    Raises:
        ValueError: an unknown unit or a negative size.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"memory size must be >= 0, got {value!r}")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):] or "b"
    if unit not in _UNITS or not digits:
        raise ValueError(f"cannot read memory size {value!r}; use e.g. 2GiB, 512MB or 1000000")
    return int(float(digits) * _UNITS[unit])
