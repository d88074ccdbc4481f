"""Commands on the stores themselves: the database schema and the embedded redis-server."""

from __future__ import annotations

import click

from orders.cli.app import cli_state, main


@main.group()
def db() -> None:
    """The database schema."""


@db.command("upgrade")
@click.option(
    "--new",
    is_flag=True,
    help="Where the SQLite file is missing (deleted or moved), create an empty database.",
)
@click.pass_context
def db_upgrade(ctx: click.Context, new: bool) -> None:
    """Create or upgrade the schema to this version (Alembic upgrade head)."""
    from orders.bootstrap import build_engine  # noqa: PLC0415
    from orders.sql import migrate  # noqa: PLC0415
    from orders.sql.engine import forget_missing_sqlite_file  # noqa: PLC0415

    engine = build_engine(cli_state(ctx).settings)
    try:
        if new:
            forget_missing_sqlite_file(engine)
        migrate.upgrade(engine)
        click.echo(f"schema at revision {migrate.current_revision(engine)}")
    finally:
        engine.dispose()


@db.command("current")
@click.pass_context
def db_current(ctx: click.Context) -> None:
    """Show the schema revision of the database and the newest one."""
    from orders.bootstrap import build_engine  # noqa: PLC0415
    from orders.sql import migrate  # noqa: PLC0415

    engine = build_engine(cli_state(ctx).settings)
    try:
        click.echo(f"database: {migrate.current_revision(engine)}, code: {migrate.head_revision()}")
    finally:
        engine.dispose()


@main.group()
def server() -> None:
    """The embedded redis-server of the home folder."""


@server.command("status")
@click.pass_context
def server_status(ctx: click.Context) -> None:
    """Show whether the embedded redis-server runs (exit 1 if not)."""
    from orders.embedded.server import redis_status  # noqa: PLC0415

    home = cli_state(ctx).settings.home
    running = redis_status(home)
    if running is None:
        click.echo(f"no embedded server runs for {home}")
        ctx.exit(1)
    click.echo(f"{running.program} pid {running.pid} at {running.url}")


@server.command("stop")
@click.pass_context
def server_stop(ctx: click.Context) -> None:
    """Stop the embedded redis-server (its data stays in the home folder)."""
    from orders.embedded.server import stop_redis  # noqa: PLC0415

    home = cli_state(ctx).settings.home
    click.echo("stopped" if stop_redis(home) else f"no embedded server ran for {home}")
