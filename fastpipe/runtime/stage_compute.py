"""What a rank computes for one (stage, microbatch): forward, backward, and
zero-bubble's input and weight halves, with checkpointing and chains.

``StageCompute`` holds the compute verbs of ``RankExecutor`` (the executor
owns the loop, the bookkeeping and the messages; this half calls autograd,
chains and deferred weight work). It reads the executor's per-step state:
``stages``, ``_saved``, ``_weights``, ``_results``, ``_chains``, ``_defers``,
``_inputs``/``_targets``/``_loss_fn``/``_train``, ``_known_loss``, the
autocast settings and the RNG lock, and calls back ``_take``, ``_deliver``,
``_send_b``, ``_count``, ``_rebook``, ``_hold``, ``_borrows``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from fastpipe._microbatch import Value, flatten, needs_grad, unflatten
from fastpipe.runtime import deferred
from fastpipe.runtime._backward import backward_full
from fastpipe.runtime.checkpoint import (NO_RANDOM, RngState, checkpointed, forgetful, guarded,
                                         recompute, seeded, stage_seed)
from fastpipe.runtime.memory import span
from fastpipe.runtime.threads import autocast
from fastpipe.schedules import Action

if TYPE_CHECKING:
    from fastpipe.runtime.executor import Stage

__all__ = ["Saved", "StageCompute"]


@dataclass
class Saved:
    """What backward needs from one F: graph roots and the stage's input leaves."""

    roots: list[torch.Tensor | GradientEdge]  # the loss tensor, or edges of the outputs
    leaves: list[torch.Tensor]
    grads: list[torch.Tensor | None] | None = None  # set once received
    rng: RngState | Any = None  # checkpointed (RngState or NO_RANDOM): roots come from a recomputation
    spec: Any = False  # structure of the stage input (see _microbatch.Spec)
    # A chain's forward: what its backward reads (roots are then the loss
    # alone, on the last stage, whose output ``out`` is a leaf).
    chain: list[torch.Tensor] | None = None
    out: torch.Tensor | None = None
    # Split schedules: the weight work the layers' backward leaves for W.
    pending: deferred.Pending | None = None



class StageCompute:
    """The compute verbs of ``RankExecutor`` (a base class of it): F, B, I, W."""

    def _forward(self, a: Action) -> None:
        stage, mb = self.stages[a.stage], a.microbatch
        if a.stage == 0:
            tensors, spec = flatten(self._inputs[mb])
            # An input that wants a gradient enters as a leaf of its own: its
            # gradient is kept (``input_grads``) and carried into the caller's
            # tensor once for the step, as the unsplit batch's backward would.
            leaves = [t.detach().to(stage.device).requires_grad_() if self._train and t.requires_grad
                      else t.to(stage.device) for t in tensors]
        else:
            received, spec = self._take(("F", a.stage, mb), a.stage - 1)
            leaves = [t.requires_grad_(self._train and t.requires_grad) for t in received]
        ckpt = self._train and checkpointed(self.checkpoint, mb, self.schedule.microbatches)
        last = a.stage == self.schedule.stages - 1
        if (a.stage in self._chains and not ckpt and spec is False
                and stage.chain.accepts(leaves[0])):
            self._forward_chain(a, stage, leaves, last)
            return
        shape_key = ("F", ckpt, *[(t.shape, t.dtype) for t in leaves]) if self._train else None
        known = stage.saved_bytes.get(shape_key) if self._train else None
        start = self._saved_bytes.total
        with guarded(self.rng_lock if stage.stochastic else None), self._seeded(stage, a):
            # Where ranks share a generator (a lock), a stage with no random
            # layer keeps no state to replay: replaying would set the shared
            # generator under another rank's seeded forward.
            rng = None if not ckpt else RngState.capture(stage.device) \
                if stage.stochastic or self.rng_lock is None else NO_RANDOM
            counting = self._train and known is None
            pending = deferred.Pending() if a.stage in self._defers and not ckpt else None
            with self._saved_bytes.counting() if counting else nullcontext():
                with forgetful() if ckpt else nullcontext(), self._autocast(), \
                        deferred.collecting(pending) if pending is not None else nullcontext():
                    out = stage.module(unflatten(leaves, spec))
                    loss = self._loss(mb, out) if last and self._train else None
        if self._train:
            if known is not None:
                self._saved_bytes.total += known
            else:
                if pending is not None:  # what deferred layers kept, beside autograd's
                    self._saved_bytes.add(pending.spans())
                if ckpt:  # the kept input is what a checkpointed microbatch holds,
                    # beyond the caller's own batch (a first stage's input on its device)
                    self._saved_bytes.total += sum(
                        n for i, (where, n) in enumerate(map(span, leaves))
                        if a.stage or where != span(tensors[i])[0])
                stage.saved_bytes[shape_key] = self._saved_bytes.total - start
            self._count((a.stage, mb), start)
        if last:
            self._finish_forward(mb, out, loss, leaves, rng, spec)
            if self._train:
                self._saved[(a.stage, mb)].pending = pending
            return
        tensors, out_spec = flatten(out)
        self._deliver(("F", a.stage + 1, mb), a.stage + 1, (tensors, out_spec))
        if self._train:
            # Keep graph edges, not the output tensors: once sent, an output's
            # memory is freed unless autograd itself saved it for backward.
            roots = [] if ckpt else [get_gradient_edge(t) for t in tensors if needs_grad(t)]
            self._saved[(a.stage, mb)] = Saved(roots, leaves, rng=rng, spec=spec, pending=pending)

    def _seeded(self, stage: Stage, a: Action):
        """A stochastic forward's own seed, where ranks share a generator (``rng_seed``)."""
        if self.rng_seed is None or not stage.stochastic:
            return nullcontext()
        return seeded(stage.device, stage_seed(self.rng_seed, a.stage, a.microbatch))

    def _forward_chain(self, a: Action, stage: Stage, leaves: list[torch.Tensor], last: bool
                       ) -> None:
        """F of a stage that runs as a Chain: no graph, the output a fresh leaf."""
        mb = a.microbatch
        out, kept = stage.chain.forward(leaves[0])
        if not self._train:
            if last:
                self._results[mb] = out
            else:
                self._deliver(("F", a.stage + 1, mb), a.stage + 1, ([out], False))
            return
        start = self._saved_bytes.total
        self._saved_bytes.total += stage.chain.saved_bytes(kept)
        # What autograd's output would say: a gradient comes back for it only
        # where something before it (a weight, the input) wants one.
        out.requires_grad_(leaves[0].requires_grad or stage.chain.trains)
        quick = None
        if last and self._known_loss is not None and out.requires_grad:
            quick = self._known_loss.value_and_grad(out, self._target(mb),
                                                    1 / self.schedule.microbatches)
        if quick is not None:
            # The loss and its gradient at once; what is kept is the gradient.
            self._results[mb] = quick[0]
            self._saved_bytes.total += quick[1].numel() * quick[1].element_size()
            saved = Saved([], leaves, [quick[1]], chain=kept)
        elif last:
            # The loss's graph is autograd's: counted as an eager forward's is.
            shape_key = ("L", out.shape, out.dtype)
            known = stage.saved_bytes.get(shape_key)
            before = self._saved_bytes.total
            with self._saved_bytes.counting() if known is None else nullcontext():
                # A copy, not the leaf itself: loss_fn may change its input in
                # place, as it may autograd's output of a layer (exact, ~3 us).
                loss = self._loss(mb, out.clone() if out.requires_grad else out)
            if known is None:
                stage.saved_bytes[shape_key] = self._saved_bytes.total - before
            else:
                self._saved_bytes.total += known
            self._results[mb] = loss.detach()
            saved = Saved([loss], leaves, [self._seed(loss)], chain=kept, out=out)
        else:
            self._deliver(("F", a.stage + 1, mb), a.stage + 1, ([out], False))
            saved = Saved([], leaves, chain=kept)
        self._count((a.stage, mb), start)
        self._saved[(a.stage, mb)] = saved

    def _chain_input(self, a: Action, saved: Saved) -> deferred.Pending:
        """I of a Chain stage: the input gradient (sent on) and W's share."""
        if saved.out is not None:  # the last stage: the loss's gradient first
            backward_full(saved.roots, saved.grads, self.keep_graphs)
            grad = saved.out.grad
        else:
            grad = saved.grads[0] if saved.grads else None
        x = saved.leaves[0]
        if grad is None:  # the output needed no gradient: nothing before it does
            self._send_input_grads(a.stage, a.microbatch, saved.leaves, [None])
            return deferred.Pending()
        gx, pending = self.stages[a.stage].chain.backward_input(saved.chain, grad, x.requires_grad)
        self._send_input_grads(a.stage, a.microbatch, saved.leaves, [gx])
        return pending

    def _autocast(self):
        return autocast(self._amp, self._amp_cache) if self._amp else nullcontext()

    def _target(self, mb: int) -> Any:
        """One microbatch's target, on the last stage's device."""
        if self._targets is None:
            raise ValueError(
                f"target is None on rank {self.rank}, which holds the last stage: it computes "
                "loss_fn(output, target) there (ranks without the last stage may pass None)")
        target = self._targets[mb]
        device = self.stages[self.schedule.stages - 1].device
        return tuple(t.to(device) for t in target) if isinstance(target, tuple) else target.to(device)

    def _loss(self, mb: int, out: Value) -> torch.Tensor:
        """The loss of one microbatch, as a 0-dim tensor (``_seed`` scales its gradient)."""
        loss = self._loss_fn(out, self._target(mb))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
        return loss if loss.dim() == 0 else loss.reshape(())

    def _seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient backward starts a microbatch's loss from: 1/m, the
        step's mean (what a division of the loss by m would pass on, without
        the op and its node)."""
        return torch.full_like(loss, 1 / self.schedule.microbatches)

    def _finish_forward(self, mb, out, loss, leaves, rng, spec) -> None:
        if not self._train:
            self._results[mb] = out
            return
        self._results[mb] = loss.detach()
        roots, grads = ([], [None]) if rng is not None else ([loss], [self._seed(loss)])
        self._saved[(self.schedule.stages - 1, mb)] = Saved(roots, leaves, grads, rng, spec)

    def _recompute(self, stage_index: int, mb: int, saved: Saved) -> None:
        """A checkpointed microbatch: its forward again, now keeping the graph."""
        stage = self.stages[stage_index]
        shape_key = ("R", *[(t.shape, t.dtype) for t in saved.leaves])
        known = stage.saved_bytes.get(shape_key)
        start = self._saved_bytes.total
        counting = self._saved_bytes.counting() if known is None else nullcontext()
        saved.pending = deferred.Pending() if stage_index in self._defers else None
        collect = deferred.collecting(saved.pending) if saved.pending is not None else nullcontext()
        with recompute(saved.rng, self.rng_lock if stage.stochastic else None, stage.norms), \
                counting, self._autocast(), collect:
            out = stage.module(unflatten(saved.leaves, saved.spec))
            if stage_index == self.schedule.stages - 1:
                loss = self._loss(mb, out)
                saved.roots, saved.grads = [loss], [self._seed(loss)]
            else:
                tensors, _ = flatten(out)
                saved.roots = [get_gradient_edge(t) for t in tensors if needs_grad(t)]
        saved.rng = None
        if known is not None:
            self._saved_bytes.total += known
        else:
            if saved.pending is not None:  # what deferred layers kept, beside autograd's
                self._saved_bytes.add(saved.pending.spans())
            stage.saved_bytes[shape_key] = self._saved_bytes.total - start
        self._count((stage_index, mb), start)

    def _grads_for(self, stage: int, mb: int) -> Saved:
        saved = self._saved[(stage, mb)]
        if saved.rng is not None:  # recompute first: the gradient may still be on its way
            self._recompute(stage, mb, saved)
        if saved.grads is None:
            grads, came = self._take(("B", stage, mb), stage + 1)
            saved.grads = list(grads)
            if came is not False:  # outputs no gradient reached start no backward
                saved.roots = [r for r, c in zip(saved.roots, came) if c]
        return saved

    def _send_input_grads(self, stage: int, mb: int, leaves, grads) -> None:
        """The gradient of each stage input that wants one: to the previous
        stage, or kept for the caller on stage 0.

        An input no gradient reached (a ``detach()``, an unused tuple member)
        sends none, so what made it keeps ``.grad`` None, as in the unsplit
        model (zeros would let weight decay and moments touch it). The
        message's spec says which came: False for all, else one bool per
        input that wants a gradient (``_grads_for`` reads it)."""
        out = [g for t, g in zip(leaves, grads) if t.requires_grad]
        if stage == 0:
            if out:
                self.input_grads[mb] = out
            return
        came = tuple(g is not None for g in out)
        self._deliver(("B", stage - 1, mb), stage - 1,
                      ([g for g in out if g is not None], False if all(came) else came))

    def _backward(self, a: Action) -> None:
        """B: I, then its W at once (or waiting to be gathered with others)."""
        key = (a.stage, a.microbatch)
        saved = self._grads_for(*key)
        del self._saved[key]
        pending = self._input_grads(a, saved)
        if pending is not None and key in self._send_after_i:
            # The gradient the previous stage waits for leaves before W
            # runs, not after: W only feeds this rank's .grad.
            self._send_b(a)
        if pending is not None:
            # The forward's tensors go with I (with keep_graphs, here, before
            # W runs); what W reads is the queue's to book from now on.
            del saved
            self._rebook(key, 0)
            self._queue_weight(self.stages[a.stage], pending)

    def _backward_input(self, a: Action) -> None:
        """I: the input gradients; the layers with a weight rule (and chain
        stages) leave their weight gradients for W (``fastpipe.runtime.deferred``),
        the rest accumulate now."""
        key = (a.stage, a.microbatch)
        saved = self._grads_for(*key)
        del self._saved[key]
        pending = self._input_grads(a, saved)
        if pending is None:
            pending = deferred.Pending()
        # Autograd's saved tensors went with I: the microbatch now holds
        # what W reads (``Pending.nbytes``), the same for the same shapes.
        shape_key = ("W", saved.chain is not None, a.stage in self._defers, bool(saved.grads),
                     *[(t.shape, t.dtype) for t in saved.leaves])
        held = self.stages[a.stage].saved_bytes.get(shape_key)
        if held is None:
            held = self.stages[a.stage].saved_bytes[shape_key] = pending.nbytes
        self._rebook(key, held)
        self._weights[key] = pending

    def _input_grads(self, a: Action, saved: Saved) -> deferred.Pending | None:
        """The stage's input gradients, sent on, and what its W has to do."""
        if saved.chain is not None:
            pending = self._chain_input(a, saved)
        else:
            grads = deferred.backward_input(saved.roots, saved.grads, saved.leaves,
                                            self.stages[a.stage].params, saved.pending,
                                            self.keep_graphs)
            self._send_input_grads(a.stage, a.microbatch, saved.leaves, grads)
            pending = saved.pending
        if pending is not None:
            # What W reads that may be a view of a received buffer, handed
            # back after W: cloned if W's work waits beyond it.
            if self._borrows((a.stage, a.microbatch)):
                pending.borrowed = deferred.borrowed_ranges((*saved.leaves, *(saved.grads or ())))
        return pending

    def _backward_weight(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        pending = self._weights.pop(key)
        self._rebook(key, 0)  # from here the queue books what waits
        self._queue_weight(self.stages[a.stage], pending)

    def _queue_weight(self, stage: Stage, pending: deferred.Pending) -> None:
        """W of one microbatch: now, or gathered with others (``WeightQueue``)."""
        before = stage.weights.nbytes
        stage.weights.add(pending, self.gather_w)
        self._hold(stage.weights.nbytes - before)

