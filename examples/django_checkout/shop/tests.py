"""The checkout end to end under Django's test runner, on the database and Redis the
settings name: TransactionTestCase, because what is checked is what really committed
(read back on orders' own connections, not Django's)."""

from __future__ import annotations

import uuid
from typing import Any
from unittest import mock

from django.db import connection, transaction
from django.test import TransactionTestCase

from orders.domain import OrderStatus
from orders.service import OrderService
from shop.glue import order_service, order_transaction
from shop.models import Cart


class CheckoutTest(TransactionTestCase):
    databases = {"default"}  # noqa: RUF012  (Django's own class attribute)

    def setUp(self) -> None:
        self.service: OrderService = order_service()
        self.user = f"user-{uuid.uuid4().hex[:12]}"
        # orders' tables are not Django's: the flush between tests leaves their rows, so
        # each test has its own user.
        self.addCleanup(setattr, self.service, "clock", self.service.clock)

    def checkout(self, total: str = "12.50") -> Any:
        return self.client.post(
            f"/users/{self.user}/checkout",
            {"total": total, "currency": "EUR"},
            content_type="application/json",
        )

    def pay(self, order_id: str, payment_ref: str) -> Any:
        return self.client.post(
            f"/orders/{order_id}/paid",
            {"payment_ref": payment_ref},
            content_type="application/json",
        )

    def in_redis(self) -> set[str]:
        return set(self.service.index.members(self.user))

    def test_checkout_commits_the_cart_and_the_order_together(self) -> None:
        answer = self.checkout()
        self.assertEqual(answer.status_code, 201, answer.content)
        order_id = answer.json()["id"]
        cart = Cart.objects.get(user_id=self.user)
        self.assertEqual(cart.order_id, order_id)
        order = self.service.get_order(order_id)  # on the service's own connection
        self.assertEqual((order.status, str(order.amount)), (OrderStatus.UNPAID, "12.50"))
        self.assertEqual(self.in_redis(), {order_id})
        self.assertEqual(answer.json()["payment_intent"], f"intent-{order_id}")

    def test_a_checkout_failing_after_the_create_leaves_neither_cart_nor_order(self) -> None:
        with (
            mock.patch("shop.views.start_payment", side_effect=RuntimeError("provider down")),
            self.assertRaisesMessage(RuntimeError, "provider down"),
        ):
            self.checkout()
        self.assertFalse(Cart.objects.filter(user_id=self.user).exists())
        self.assertEqual(self.service.list_unpaid(self.user), [])
        self.assertEqual(self.in_redis(), set())  # the slot is free again
        for _ in range(self.service.settings.unpaid_limit):
            self.assertEqual(self.checkout().status_code, 201)

    def test_checkouts_past_the_limit_are_refused_with_retry_after(self) -> None:
        limit = self.service.settings.unpaid_limit
        admitted = [self.checkout() for _ in range(limit)]
        self.assertEqual([a.status_code for a in admitted], [201] * limit)
        refused = self.checkout()
        self.assertEqual(refused.status_code, 429, refused.content)
        retry_after = int(refused.headers["Retry-After"])
        self.assertTrue(0 < retry_after <= self.service.settings.default_policy.ttl_s)
        self.assertEqual(refused.json()["limit"], limit)
        self.assertEqual(Cart.objects.filter(user_id=self.user).count(), limit)
        self.assertEqual(self.in_redis(), {a.json()["id"] for a in admitted})

    def test_the_webhook_pays_the_order_and_records_it_on_the_cart(self) -> None:
        order_id = self.checkout().json()["id"]
        self.assertEqual(self.in_redis(), {order_id})
        answer = self.pay(order_id, "psp-1")
        self.assertEqual(answer.status_code, 200, answer.content)
        self.assertEqual((answer.json()["status"], answer.json()["payment_ref"]), ("paid", "psp-1"))
        self.assertEqual(self.service.get_order(order_id).status, OrderStatus.PAID)
        self.assertEqual(Cart.objects.get(order_id=order_id).payment_ref, "psp-1")
        self.assertEqual(self.in_redis(), set())  # left the index when Django committed

    def test_a_payment_after_the_sweep_closed_the_order_is_refused_for_a_refund(self) -> None:
        order_id = self.checkout().json()["id"]
        expires_at_ms = self.service.get_order(order_id).expires_at_ms
        self.service.clock = lambda: expires_at_ms + 1000
        self.assertGreaterEqual(self.service.sweep_expired().closed, 1)
        answer = self.pay(order_id, "psp-late")
        self.assertEqual(answer.status_code, 409, answer.content)
        self.assertEqual(answer.json()["refund"], {"required": True, "payment_ref": "psp-late"})
        self.assertEqual(answer.json()["status"], "closed")
        self.assertIsNone(Cart.objects.get(order_id=order_id).payment_ref)
        self.assertEqual(self.service.get_order(order_id).status, OrderStatus.CLOSED)

    def test_inside_an_outer_atomic_the_payment_waits_for_the_outer_commit(self) -> None:
        order_id = self.checkout().json()["id"]
        with transaction.atomic():  # as ATOMIC_REQUESTS would wrap a view
            with order_transaction() as conn:
                self.service.mark_paid(order_id, payment_ref="psp-1", connection=conn)
            self.assertEqual(self.in_redis(), {order_id})  # not committed yet
        self.assertEqual(self.service.get_order(order_id).status, OrderStatus.PAID)
        self.assertEqual(self.in_redis(), set())

    def test_with_atomic_requests_checkout_and_payment_follow_the_requests_commit(self) -> None:
        settings_dict = connection.settings_dict
        with mock.patch.dict(settings_dict, {"ATOMIC_REQUESTS": True}):
            order_id = self.checkout().json()["id"]
            self.assertEqual(self.in_redis(), {order_id})
            self.assertEqual(self.pay(order_id, "psp-1").status_code, 200)
        self.assertEqual(self.service.get_order(order_id).status, OrderStatus.PAID)
        self.assertEqual(self.in_redis(), set())

    def test_a_failure_inside_an_outer_atomic_undoes_only_its_own_block(self) -> None:
        with transaction.atomic():
            kept = Cart.objects.create(user_id=self.user, total="1.00", currency="EUR")
            with self.assertRaisesMessage(RuntimeError, "inner"), order_transaction() as conn:
                self.service.create_unpaid_order(self.user, connection=conn)
                raise RuntimeError("inner")
            self.assertEqual(self.in_redis(), set())  # its savepoint rolled back: slot free
        self.assertTrue(Cart.objects.filter(pk=kept.pk).exists())  # the outer block's row
        self.assertEqual(self.service.list_unpaid(self.user), [])

    def test_an_outer_rollback_leaves_a_member_that_reconcile_removes(self) -> None:
        with self.assertRaisesMessage(RuntimeError, "outer"), transaction.atomic():
            with order_transaction() as conn:
                order = self.service.create_unpaid_order(self.user, connection=conn)
            raise RuntimeError("outer")
        self.assertEqual(self.service.list_unpaid(self.user), [])
        self.assertEqual(self.in_redis(), {order.id})  # Django told nobody
        window_ms = self.service.settings.admission_window_ms
        self.service.clock = lambda: order.created_at_ms + window_ms + 1
        self.service.reconcile()
        self.assertEqual(self.in_redis(), set())
