"""The benchmarks' round robin: every callable timed in every round, in an
order each round draws the same way on every rank."""

from bench._runner import round_robin_medians


def _calls(rounds: int) -> tuple[list[str], dict]:
    seen: list[str] = []
    fns = {name: (lambda name=name: seen.append(name)) for name in "abcdef"}
    times = round_robin_medians(fns, warmup=0, rounds=rounds, sync=lambda: None, per_round=1, settle=0)
    return seen, times


def test_each_round_times_every_callable_in_an_order_of_its_own():
    seen, times = _calls(rounds=6)
    assert set(times) == set("abcdef") and all(t >= 0 for t in times.values())
    orders = [seen[i:i + 6] for i in range(0, len(seen), 6)]
    assert all(sorted(o) == list("abcdef") for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # not the same order every round
    assert _calls(rounds=6)[0] == seen  # every rank draws the same orders
