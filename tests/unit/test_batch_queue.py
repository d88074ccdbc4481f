"""The combining queue's lane: a call made from inside the call in flight, on its thread,
goes alone at once instead of waiting for itself (orders.rules.batching)."""

from __future__ import annotations

import threading

from orders.rules.batching import BatchQueue, Seat


class Call:
    def __init__(self) -> None:
        self.seat: Seat[Call] = Seat()


def new_queue() -> BatchQueue[Call]:
    return BatchQueue(lambda call: call.seat, max_batch=8, kind="test")


def test_only_the_thread_in_flight_holds_the_lane() -> None:
    queue = new_queue()
    assert not queue.holds_lane()
    assert queue.enter(Call())
    assert queue.holds_lane()
    seen: list[bool] = []
    other = threading.Thread(target=lambda: seen.append(queue.holds_lane()))
    other.start()
    other.join()
    assert seen == [False]
    queue.hand_over()
    assert not queue.holds_lane()


def test_the_leader_of_a_batch_holds_the_lane_while_it_runs() -> None:
    queue = new_queue()
    assert queue.enter(Call())
    first, second = Call(), Call()
    assert not queue.enter(first)
    assert not queue.enter(second)
    held_while_running: list[bool] = []
    leader = threading.Thread(
        target=lambda: (
            queue.wait(first),
            queue.lead(
                first.seat.batch or [], lambda _b: held_while_running.append(queue.holds_lane())
            ),
        )
    )
    leader.start()
    queue.hand_over()  # the call alone ends: `first` leads both
    leader.join(timeout=10)
    assert not leader.is_alive()
    assert held_while_running == [True]
    assert second.seat.ready.is_set()
    assert not queue.holds_lane()
    assert queue.enter(Call())  # the lane is free again


def test_callers_behind_a_stuck_call_go_alone_and_later_ones_do_not_queue() -> None:
    queue: BatchQueue[Call] = BatchQueue(lambda call: call.seat, 8, "test", patience_s=0.05)
    assert queue.enter(Call())  # runs alone, and never ends: stuck (a lock, a hung pool)
    behind = Call()
    assert not queue.enter(behind)  # the call in flight is young: it queues
    assert queue.queued == 1

    assert queue.wait(behind) is None  # past the patience: its turn to go alone
    assert behind.seat.batch is None
    assert queue.queued == 0
    later = Call()
    assert not queue.enter(later)  # still stuck: not queued, ready at once
    assert later.seat.ready.is_set()
    assert later.seat.batch is None
    assert queue.queued == 0
    assert (queue.stats.alone, queue.stats.went_past, queue.stats.calls) == (1, 2, 3)

    queue.hand_over()  # the stuck call ends: the lane is free again
    assert queue.enter(Call())
