"""The benchmarks' workload names: what a rank is handed resolves to the same model."""

import argparse

import pytest

from bench._workloads import WORKLOADS, selected, workload


def test_a_name_resolves_to_its_workload_and_depth():
    assert workload("gpt-overhead") is WORKLOADS["gpt-overhead"]
    deeper = workload("gpt-overhead@14")
    assert deeper.sizes["blocks"] == 14 and deeper.name == "gpt-overhead@14"
    assert workload(deeper.name) == deeper
    assert len(deeper.build()) == 14 + 2  # embedding, blocks, head
    assert {k: v for k, v in deeper.sizes.items() if k != "blocks"} == {
        k: v for k, v in WORKLOADS["gpt-overhead"].sizes.items() if k != "blocks"}


def test_blocks_deepen_the_transformers_only():
    args = argparse.Namespace(model="both", workload="overhead", blocks=10)
    gpt, mlp = selected(args)
    assert gpt.name == "gpt-overhead@10" and gpt.sizes["blocks"] == 10
    assert mlp is WORKLOADS["mlp-overhead"]
    plain = selected(argparse.Namespace(model="gpt", workload="both"))
    assert [w.name for w in plain] == ["gpt-compute", "gpt-overhead"]


def test_no_blocks_is_refused_by_name():
    with pytest.raises(ValueError, match="at least one block, got 0"):
        selected(argparse.Namespace(model="gpt", workload="overhead", blocks=0))


def test_a_given_split_replaces_the_profiled_one_for_its_schedule_only():
    from bench._runner import workload_parser
    from fastpipe.schedules import build

    args = workload_parser("bench", None, ["zbv"]).parse_args(
        ["--model", "gpt", "--workload", "overhead", "--balance", "zbv=3,1,2,2"])
    (w,) = selected(args)
    assert w.balance(build("zbv", 2, w.chunks, stages_per_rank=2)) == [3, 1, 2, 2]
    assert dict(w.splits) == {"zbv": (3, 1, 2, 2)}  # others (1f1b here) keep the profiled split
    for bad in ("zbv", "zbv=", "zbv=3,x", "zbv=0,4", "=4,4"):
        with pytest.raises(SystemExit):
            workload_parser("bench", None, ["zbv"]).parse_args(["--balance", bad])
