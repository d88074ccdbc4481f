"""The use cases are written down in five places: :class:`OrderService`'s methods, the
module-level functions of ``orders``, :class:`AsyncOrderService`'s methods, the module-level
functions of ``orders.aio``, and the two ``__all__`` lists. Each place is written by hand
(the module functions keep their own signatures, so a type checker and ``help()`` see them),
so these tests hold them to one another: a use case added to one and not the others fails
here. No servers: only imports and signatures."""

from __future__ import annotations

import inspect
import runpy
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import pytest

import orders
import orders.aio
from orders.aio.service import AsyncOrderService, Awaited
from orders.service import OrderService

#: OrderService's public methods that are not use cases: lifecycle, the scheduler's and the
#: operator's wiring. A new public method is either a use case (and then in every list) or
#: named here.
NOT_USE_CASES = {
    "close",
    "count_due",
    "earliest_unpaid_expiry_ms",
    "earliest_reminder_ms",
    "now_ms",
    "on_closed",
    "on_payment_refused",
    "set_late_payment_check",
    "set_pre_close_check",
    # The incident pause: an operator's action (orders pause / resume), not a checkout's.
    "pause",
    "resume",
    "current_pause",
    "recent_pauses",
    # Retention: the scheduler's job and the operator's orders prune.
    "prune",
    "set_archive_hook",
    # Bulk actions: an operator's (orders cancel / extend by filter).
    "cancel_matching",
    "extend_matching",
    # Erasure: an operator's (orders erase-user), which AsyncOrderService mirrors too.
    "erase_user",
}
#: Operator methods AsyncOrderService awaits as well (a host's request handler may take
#: them), with no module function.
AWAITED_OPERATOR_METHODS = {"erase_user"}
#: The module-level functions that bind or build the default service: no use case.
WIRING = {"configure", "default_service", "build_async_service"}


def public_methods(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def module_functions(namespace: Mapping[str, Any], module_name: str) -> dict[str, Any]:
    """The public functions a module's namespace defines, or builds from an
    :class:`AsyncOrderService` method (``on_default``), leaving out its imports."""
    return {
        name: value
        for name, value in namespace.items()
        if inspect.isfunction(value) and not name.startswith("_") and name not in WIRING
        if value.__module__ == module_name or isinstance(getattr(value, "__wrapped__", 0), Awaited)
    }


#: ``orders/__init__.py`` run again on its own: the package's own functions, whatever an
#: import of one of its submodules has since bound to the same name in the package.
AS_WRITTEN = "orders, as written"
ORDERS_FUNCTIONS = module_functions(
    runpy.run_path(str(orders.__file__), run_name=AS_WRITTEN), AS_WRITTEN
)


def exported_functions(module: ModuleType) -> set[str]:
    names = set(module.__all__) - WIRING
    return {name for name in names if name[0].islower()}


USE_CASES = public_methods(OrderService) - NOT_USE_CASES


def test_the_use_cases_are_found() -> None:
    # A floor, so the comparisons below cannot pass on two empty sets.
    assert {"create_unpaid_order", "mark_paid", "sweep_expired", "reconcile"} <= USE_CASES


def test_orders_has_a_module_function_for_each_use_case_and_exports_it() -> None:
    assert set(ORDERS_FUNCTIONS) == USE_CASES
    assert exported_functions(orders) == USE_CASES


def test_the_async_service_awaits_each_use_case_of_the_service() -> None:
    awaited = {
        name: value for name, value in vars(AsyncOrderService).items() if isinstance(value, Awaited)
    }

    assert set(awaited) == USE_CASES | AWAITED_OPERATOR_METHODS
    for name, value in awaited.items():
        assert value.method is getattr(OrderService, name)


def test_orders_aio_has_a_module_function_for_each_use_case_and_exports_it() -> None:
    assert set(module_functions(vars(orders.aio), "orders.aio")) == USE_CASES
    assert exported_functions(orders.aio) == USE_CASES
    for name in USE_CASES:
        assert getattr(orders.aio, name).__wrapped__ is vars(AsyncOrderService)[name]


def parameters(function: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    found = dict(inspect.signature(function).parameters)
    found.pop("self", None)
    return found


@pytest.mark.parametrize("name", sorted(USE_CASES))
def test_a_module_function_takes_what_the_method_takes(name: str) -> None:
    """The same names, kinds, defaults and annotations; a module function may leave out
    keyword arguments meant for the scheduler or the CLI (``should_stop``, ``on_progress``)."""
    function = ORDERS_FUNCTIONS[name]
    method = parameters(getattr(OrderService, name))
    given = parameters(function)

    assert set(given) <= set(method)
    for parameter in given.values():
        assert parameter == method[parameter.name]
    for left_out in set(method) - set(given):
        assert method[left_out].default is not inspect.Parameter.empty, left_out
    assert (
        inspect.signature(function).return_annotation
        == inspect.signature(getattr(OrderService, name)).return_annotation
    )


def test_each_module_function_is_still_a_function_once_the_service_is_loaded() -> None:
    """A submodule named like a use case (orders.reconcile, as it once was) is bound over
    the function in the package when OrderService imports it."""
    for name in sorted(USE_CASES):
        assert inspect.isfunction(getattr(orders, name)), name
