"""The native ring and each rank's device lanes that a runner uses: made on
first use, given back by ``close`` (CUDA streams to the process's pool,
``runtime/streams.py``), made afresh by a later step."""

from __future__ import annotations

from typing import Any

import torch

from fastpipe.runtime.lanes import lanes_for

__all__ = ["RingLanes"]


class RingLanes:
    """Attributes:
        ring: the native ``HostRing``, or None until ``ring_for``.
        device_lanes: rank -> its device lanes (CUDA streams, or host lanes
            on the current ring), made once per ring.
    """

    def __init__(self, timeout: float, overlap: bool) -> None:
        self.timeout, self.overlap = timeout, overlap
        self.ring = None
        self.device_lanes: dict[int, Any] = {}

    def ring_for(self, lanes: int):
        """The ring, made with ``lanes`` lanes if there is none."""
        from fastpipe._ext import native

        if self.ring is None:
            self.ring = native().HostRing(lanes)
        return self.ring

    def of(self, rank: int, device: torch.device, lane: int):
        """Rank ``rank``'s device lanes (``lane`` of the ring runs its copies on host lanes)."""
        lanes = self.device_lanes.get(rank)
        if lanes is None or getattr(lanes, "ring", self.ring) is not self.ring:
            lanes = lanes_for(device, self.ring, lane, self.timeout, overlap=self.overlap)
            self.device_lanes[rank] = lanes
        return lanes

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for lanes in self.device_lanes.values():
            lanes.close()
        self.device_lanes.clear()
