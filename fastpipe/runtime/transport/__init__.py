"""Moving stage values between pipeline ranks: in one process, or over torch.distributed.

Every transport takes the verbs of :class:`Transport` (``base``), so the
executor has one code path. One module per concern:

    base     the Transport and PendingReceive contracts, keys, PeerError
    local    ranks on threads of one process: a shared native Mailbox
    copies   local ranks on GPUs: copies into receive slots on a copy lane
    wire     the message format between processes (prefix, head, data)
    groups   the process groups messages travel on, and their first connection
    dist     one rank over torch.distributed (gloo, or NCCL with exact sizes)
    abort    a failing distributed rank: abort notices, then the step drained

Same-host CPU pipelines use shared-memory rings instead (``fastpipe.runtime.shm``).
"""

from __future__ import annotations

from fastpipe.runtime.transport.base import (
    CommLanes, Key, Payload, PeerError, PendingReceive, SlotReceive, Transport, describe,
    timeout_message,
)
from fastpipe.runtime.transport.copies import CopyTransport, ReceiveRings
from fastpipe.runtime.transport.dist import DistTransport
from fastpipe.runtime.transport.groups import connect_pairs, flow_groups, late_groups
from fastpipe.runtime.transport.local import LocalTransport, Mailbox
from fastpipe.runtime.transport.wire import (
    CallMismatch, check_mode, decode_head, encode_head, head_block, read_head, received,
    sender_orders, step_mode, write_head,
)

__all__ = [
    "CallMismatch", "CommLanes", "CopyTransport", "DistTransport", "Key", "LocalTransport",
    "Mailbox", "Payload", "PeerError", "PendingReceive", "ReceiveRings", "SlotReceive",
    "Transport", "check_mode", "connect_pairs", "decode_head", "describe", "encode_head",
    "flow_groups", "head_block", "late_groups", "read_head", "received", "sender_orders",
    "step_mode", "timeout_message", "write_head",
]
