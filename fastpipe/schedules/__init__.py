"""Schedules as data: the IR, eight generators, lowering, a validator, a simulator, CSV, pictures.

A schedule is one ordered list of actions per pipeline rank (``1F0``,
``0I3``, ``2W1``, ``0SEND_F1``: torch.distributed.pipelining's strings).
Everything here is pure Python: no process group, no tensors.

Example:
    >>> from fastpipe.schedules import build
    >>> schedule = build("zbv", ranks=4, microbatches=8)
    >>> schedule.validate()
    >>> round(schedule.simulate({"F": 1, "I": 1, "W": 1}).bubble_ratio, 4)  # 3 / 51
    0.0588
"""

from fastpipe.schedules._csv import load_csv, save_csv
from fastpipe.schedules._ir import Action, Kind, Schedule
from fastpipe.schedules._lower import lower
from fastpipe.schedules._registry import build, names, orders_by_cost
from fastpipe.schedules._simulate import Simulation, TimelineRecord, simulate
from fastpipe.schedules._validate import ScheduleError, validate

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "TimelineRecord",
    "build",
    "load_csv",
    "lower",
    "names",
    "orders_by_cost",
    "save_csv",
    "simulate",
    "validate",
]
