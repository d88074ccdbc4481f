"""The bench's async timing (``measure.run_tasks``): N tasks gathered on the one running
loop, each operation once; 1 task awaits them in turn; a failing task stops the run."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.measure import Run, run_tasks


class Probe:
    """An operation that yields to the loop twice and records what ran alongside it."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most_in_flight = 0
        self.done: list[int] = []
        self.loops: set[int] = set()

    async def __call__(self, i: int) -> None:
        self.loops.add(id(asyncio.get_running_loop()))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.in_flight -= 1
        self.done.append(i)


@pytest.mark.parametrize(("tasks", "in_flight"), [(1, 1), (8, 8), (64, 40)])
def test_tasks_run_at_once_on_one_loop_and_each_operation_runs_once(
    tasks: int, in_flight: int
) -> None:
    probe = Probe()

    async def main() -> tuple[Run, int]:
        return await run_tasks(probe, 40, tasks), id(asyncio.get_running_loop())

    run, loop = asyncio.run(main())

    assert sorted(probe.done) == list(range(40))
    assert probe.most_in_flight == in_flight  # 1 task: one awaited at a time
    assert probe.loops == {loop}
    assert run.ops == 40
    assert len(run.latencies_ns) == 40
    assert run.elapsed_ns > 0


def test_one_task_awaits_the_operations_in_order() -> None:
    probe = Probe()

    asyncio.run(run_tasks(probe, 10, 1))

    assert probe.done == list(range(10))


def test_a_failing_task_fails_the_run_with_its_own_error_and_stops_the_others() -> None:
    probe = Probe()

    async def op(i: int) -> None:
        if i == 3:
            raise RuntimeError("op 3 failed")
        await probe(i)

    with asyncio.Runner() as runner:  # one loop for every run, as the bench's
        with pytest.raises(RuntimeError, match="op 3 failed"):
            runner.run(run_tasks(op, 400, 4))
        done = len(probe.done)
        runner.run(asyncio.sleep(0.05))  # the loop runs again: nothing of the failed run does

    assert len(probe.done) == done < 399
