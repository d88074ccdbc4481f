"""No module of ``orders`` touches a private name of another library.

A name with one leading underscore (not a ``__dunder__``) of redis-py, SQLAlchemy, asyncio,
greenlet or any package that is not ``orders`` can change in any release without notice;
``orders`` caps its dependencies below releases it has not tested, but it must not need to.
Four ways in are checked:

a. ``something._name`` where ``_name`` is defined nowhere in ``orders`` (no def, class,
   assignment, ``self._x =``, parameter, import alias, ``__slots__`` entry);
b. ``from lib import _name``, ``import lib._mod``, ``from lib._mod import x``, and the
   import of a package a library keeps out of its API though its name has no underscore
   (:data:`INTERNAL_PACKAGES`);
c. ``getattr``/``setattr``/``hasattr``/``delattr`` with such a name as a string literal;
d. at runtime, an ``orders`` class whose own code defines (a method, a class attribute) or
   uses (``self._x``) a private name that a base class outside ``orders`` has too: an
   override of a library's private method, or a read or write of its private state.

A private name of ``orders`` used by another ``orders`` module is a separate rule, not
checked here.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

import orders

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "orders"

#: Underscored names that their library documents as public API, each with where it says so.
DOCUMENTED_AS_PUBLIC = {
    # "Row._mapping ... the underscore avoids name conflicts with column names":
    # https://docs.sqlalchemy.org/en/20/core/connections.html#sqlalchemy.engine.Row._mapping
    "_mapping": "SQLAlchemy Row._mapping",
}

#: Packages of other libraries that carry no underscore and are still not their API: the
#: import of one is reported like that of a private module (b).
INTERNAL_PACKAGES = {
    # Not in SQLAlchemy's API reference; on 2.0 its greenlet bridge (await_only,
    # greenlet_spawn) is defined in sqlalchemy.util._concurrency_py3k and re-exported here.
    "sqlalchemy.util": "SQLAlchemy's internal helpers",
}

#: Modules that only run as programs: their code is read (a, b, c) but never imported.
NOT_IMPORTED = {
    "orders.__main__": "runs the command line",
    "orders._migrations.env": "runs only under Alembic",
}

ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    """One or more leading underscores, and not a ``__dunder__``."""
    return (
        name.startswith("_")
        and name.strip("_") != ""
        and not (name.startswith("__") and name.endswith("__"))
    )


def is_sunder(name: str) -> bool:
    """``_name_``: the hooks enum documents for overriding (``_missing_``...)."""
    return name.startswith("_") and name.endswith("_") and not name.startswith("__")


def is_own_module(module: str) -> bool:
    return module == "orders" or module.startswith("orders.")


def internal(module: str) -> str | None:
    """Why ``module`` (dotted) is not a library's API, or None if nothing says so."""
    if is_own_module(module):
        return None
    if any(map(is_private, module.split("."))):
        return "a private module"
    for package, why in INTERNAL_PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return why
    return None


# --- a, b, c: the source ----------------------------------------------------------------------


def defined_names(tree: ast.AST) -> Iterator[str]:
    """Every name the code of ``tree`` defines (whatever it then does with it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in {"self", "cls"}
        ):
            yield node.attr
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.asname or node.name.partition(".")[0]
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            yield node.name
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                yield from (
                    c.value
                    for c in ast.walk(node.value or ast.Constant(None))
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )


def import_violations(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """b: a private module or name imported from a package that is not ``orders``, or one
    of the :data:`INTERNAL_PACKAGES`."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if why := internal(alias.name):
                yield f"imports {alias.name}: {why}"
        return
    if node.level or node.module is None or is_own_module(node.module):
        return
    if why := internal(node.module):
        yield f"imports from {node.module}: {why}"
        return
    for alias in node.names:
        if is_private(alias.name):
            yield f"imports the private name {alias.name} from {node.module}"
        elif why := internal(f"{node.module}.{alias.name}"):
            yield f"imports {node.module}.{alias.name}: {why}"


def source_violations(sources: dict[str, str]) -> list[str]:
    """a, b, c over ``{path: source}``: ``path:line: what`` for each."""
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    own = {name for tree in trees.values() for name in defined_names(tree)}

    def foreign(name: str) -> bool:
        return is_private(name) and name not in own and name not in DOCUMENTED_AS_PUBLIC

    found: list[str] = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            what: list[str] = []
            if isinstance(node, ast.Attribute) and foreign(node.attr):
                what.append(f"uses the attribute .{node.attr}, which orders does not define")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                what.extend(import_violations(node))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ATTRIBUTE_FUNCTIONS
                and len(node.args) >= 2
                and isinstance(name := node.args[1], ast.Constant)
                and isinstance(name.value, str)
                and foreign(name.value)
            ):
                what.append(f"{node.func.id}(..., {name.value!r}): orders does not define it")
            found += [f"{path}:{node.lineno}: {w}" for w in what]
    return found


def package_sources() -> dict[str, str]:
    """The package's modules, and the benchmark lab's beside it (it holds to the same rule)."""
    paths = sorted([*PACKAGE.rglob("*.py"), *(REPO / "benchmarks").glob("*.py")])
    return {str(path.relative_to(REPO)): path.read_text() for path in paths}


# --- d: classes at runtime --------------------------------------------------------------------


def self_attributes(tree: ast.AST) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            yield node.attr, node.lineno


def class_source(cls: type) -> tuple[ast.ClassDef, int] | None:
    """The class statement of ``cls`` and the line it starts on, if its source is there."""
    try:
        lines, start = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    return (node, start) if isinstance(node, ast.ClassDef) else None


@functools.cache
def library_names(base: type) -> frozenset[str]:
    """What a class outside ``orders`` has: its attributes and its ``self._x``."""
    source = class_source(base)
    used = {name for name, _ in self_attributes(source[0])} if source else set()
    return frozenset(vars(base)) | frozenset(used)


def written_names(node: ast.ClassDef) -> Iterator[tuple[str, int]]:
    """What a class statement defines in its body, and every ``self._x`` its methods use."""
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield statement.name, statement.lineno
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id, statement.lineno
    yield from self_attributes(node)


def override_violations(cls: type, path: str) -> Iterator[str]:
    """d: private names of ``cls``'s own code that a base outside ``orders`` also has."""
    source = class_source(cls)
    if source is None:
        return
    node, start = source
    bases = [b for b in cls.__mro__[1:] if not is_own_module(b.__module__)]
    reported: set[str] = set()
    for name, line in written_names(node):
        if not is_private(name) or is_sunder(name) or name in reported:
            continue
        owners = [b for b in bases if name in library_names(b)]
        if owners:
            reported.add(name)
            owner = owners[0]
            yield (
                f"{path}:{start + line - 1}: {cls.__qualname__}.{name} is also "
                f"{owner.__module__}.{owner.__qualname__}.{name}, a private name of a library"
            )


def classes_of(module: ModuleType) -> Iterator[type]:
    """The classes ``module`` defines, nested ones included."""
    pending = [v for v in vars(module).values() if isinstance(v, type)]
    seen: set[type] = set()  # a class can be bound to more than one name
    while pending:
        cls = pending.pop()
        if cls.__module__ == module.__name__ and cls not in seen:
            seen.add(cls)
            yield cls
            pending += [v for v in vars(cls).values() if isinstance(v, type)]


def package_modules() -> tuple[list[ModuleType], list[str]]:
    """Every importable module of ``orders``; and those skipped for a missing import."""
    modules: list[ModuleType] = [orders]
    skipped: list[str] = []
    for info in pkgutil.walk_packages(orders.__path__, "orders."):
        if info.name in NOT_IMPORTED:
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if exc.name is None or is_own_module(exc.name):
                raise
            skipped.append(f"{info.name} (needs {exc.name})")
    return modules, skipped


def runtime_violations(modules: Iterable[ModuleType]) -> list[str]:
    found: list[str] = []
    for module in modules:
        file = Path(module.__file__ or "")
        path = str(file.relative_to(REPO)) if file.is_relative_to(REPO) else str(file)
        for cls in classes_of(module):
            found += override_violations(cls, path)
    return found


# --- the rule ---------------------------------------------------------------------------------


def test_no_module_of_orders_touches_a_private_name_of_another_library() -> None:
    sources = package_sources()
    assert len(sources) > 50  # the walk found the package
    modules, skipped = package_modules()
    if skipped:
        print("not imported, an optional dependency is missing:", ", ".join(skipped))
    found = source_violations(sources) + runtime_violations(modules)
    assert found == [], "private names of other libraries:\n" + "\n".join(found)


# --- the checker, on snippets -----------------------------------------------------------------

SNIPPET_VIOLATIONS = {
    "a": "import redis\n\ndef f(conn: redis.Connection) -> None:\n    conn._sock.close()\n",
    "b1": "from redis.connection import _HiredisParser\n",
    "b2": "import sqlalchemy.util._concurrency_py3k\n",
    "b3": "from sqlalchemy.util._concurrency_py3k import greenlet_spawn\n",
    "b4": "from sqlalchemy import util as sa_util\n",
    "c": "def f(retry: object) -> object:\n    return getattr(retry, '_backoff')\n",
}


def test_the_checker_reports_each_kind_of_use() -> None:
    for kind, text in SNIPPET_VIOLATIONS.items():
        found = source_violations({f"orders/{kind}.py": text})
        assert len(found) == 1, (kind, found)
        assert found[0].startswith(f"orders/{kind}.py:"), found
    assert source_violations({"orders/a.py": SNIPPET_VIOLATIONS["a"]}) == [
        "orders/a.py:4: uses the attribute ._sock, which orders does not define"
    ]


def test_the_checker_leaves_the_packages_own_private_names_alone() -> None:
    own = {
        "orders/x.py": (
            "from dataclasses import dataclass\n\n"
            "class Pacer:\n"
            "    __slots__ = ('_slot',)\n\n"
            "    def __init__(self, _limit: int) -> None:\n"
            "        self._last = _limit\n\n"
            "def _helper() -> None: ...\n\n"
            "@dataclass\n"
            "class Field:\n"
            "    _kept: int = 0\n"
        ),
        "orders/y.py": (
            "from orders import _migrations as _m\n"
            "from orders.x import Pacer, Field, _helper\n\n"
            "def g(p: Pacer, f: Field) -> object:\n"
            "    _helper()\n"
            "    return (p._last, p._slot, f._kept, getattr(p, '_last'), _m.__name__)\n"
        ),
    }
    assert source_violations(own) == []


def test_the_checker_finds_an_override_of_a_librarys_private_method(tmp_path: Path) -> None:
    path = tmp_path / "fake_module.py"
    path.write_text(
        "import redis.connection\n\n"
        "class Mine(redis.connection.UnixDomainSocketConnection):\n"
        "    def _connect(self):\n"
        "        return super()._connect()\n\n"
        "    def _own_helper(self) -> None:\n"
        "        self._sock = None\n"
    )
    name = "orders._public_ground_self_test"  # an orders module, for the checker
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        found = runtime_violations([module])
    finally:
        del sys.modules[name]
    assert [v.partition(": ")[2].partition(" is also ")[0] for v in found] == [
        "Mine._connect",
        "Mine._sock",
    ], found
    assert found[0].startswith(f"{path}:4: ")
