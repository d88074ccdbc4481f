from __future__ import annotations

from django.db import models


class Cart(models.Model):
    """A user's cart at checkout; ``order_id`` is the unpaid order orders holds for it."""

    user_id = models.CharField(max_length=128)
    total = models.DecimalField(max_digits=12, decimal_places=2)
    currency = models.CharField(max_length=3)
    order_id = models.CharField(max_length=64, unique=True, null=True)
    payment_ref = models.CharField(max_length=255, null=True)
    created_at = models.DateTimeField(auto_now_add=True)
