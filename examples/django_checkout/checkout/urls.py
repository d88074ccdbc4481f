from django.urls import path
from shop import views

urlpatterns = [
    path("users/<str:user_id>/checkout", views.checkout, name="checkout"),
    path("orders/<str:order_id>/paid", views.payment_webhook, name="payment-webhook"),
]
