"""Many threads, each running host transactions that create, pay and cancel orders through
``connection=`` and then commit or roll back at random, against a small limit.

The limit is checked in SQL after every commit (a user's unpaid orders never exceed it),
and at the end both stores must agree: each user's Redis members are exactly its open SQL
orders, with nothing left over from the rolled-back creates and nothing missing after the
committed payments. On SQLite and PostgreSQL; the clock stands still, so nothing expires.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable

from sqlalchemy import Engine, func, select

from orders.errors import OrdersError, StoreUnavailable, UnpaidOrderLimitReached
from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.host_app import members, open_orders

THREADS = 8
USERS = 3
LIMIT = 2
JOIN_TIMEOUT_S = 90


def unpaid_of(engine: Engine, user_id: str) -> int:
    with engine.connect() as conn:
        query = select(func.count()).where(
            orders_table.c.user_id == user_id, orders_table.c.status == "unpaid"
        )
        return int(conn.execute(query).scalar_one())


def test_random_host_rollbacks_keep_the_limit_and_the_stores_equal(
    make_service: Callable[..., OrderService], engine: Engine, full_size: bool
) -> None:
    service = make_service(unpaid_limit=LIMIT)
    rounds = 150 if full_size else 40
    tally: Counter[str] = Counter()
    breaches: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def host(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(rounds):
                user = f"u{rng.randrange(USERS)}"
                with engine.connect() as conn:
                    try:
                        if rng.random() < 0.7:
                            service.create_unpaid_order(user, connection=conn)
                            what = "create"
                        else:
                            open_ids = sorted(open_orders(engine).get(user, ()))
                            if not open_ids:
                                continue
                            use_case = rng.choice([service.mark_paid, service.cancel_order])
                            use_case(rng.choice(open_ids), connection=conn)
                            what = "transition"
                    except UnpaidOrderLimitReached:
                        what = "refused"
                    except StoreUnavailable:
                        what = "busy"  # SQLite's writer lock, held by another host: give up
                    except OrdersError:
                        what = "lost"  # the order was paid or cancelled meanwhile
                    committed = what in ("create", "transition") and rng.random() < 0.5
                    if committed:
                        conn.commit()
                    else:
                        conn.rollback()
                if committed and unpaid_of(engine, user) > LIMIT:
                    breaches.append(user)
                with lock:
                    tally[f"{what}_{'committed' if committed else 'rolled_back'}"] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=host, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    print(f"\n{dict(tally)}")
    assert breaches == []
    sql = open_orders(engine)
    for n in range(USERS):
        user = f"u{n}"
        assert len(sql.get(user, set())) <= LIMIT
        assert members(service, user) == sql.get(user, set()), user
    # The run did what it is about: each kind of outcome happened.
    for kind in ("create_committed", "create_rolled_back", "refused_rolled_back"):
        assert tally[kind] > 0, kind
    assert tally["transition_committed"] + tally["transition_rolled_back"] > 0
