"""Open the database behind files and batches, with the schema created if it is missing.

SQLite (a file under the data directory) is the default and needs nothing started; a `postgresql://` URL is
opened with psycopg 3 and lets several gateways share the state. SQLite runs in WAL mode with synchronous=FULL,
so a commit is on disk when it returns, and every transaction begins IMMEDIATE (takes the write lock at once),
so two writers queue on the busy timeout instead of failing on a lock upgrade.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url

from gateway.store.tables import metadata

SQLITE_BUSY_TIMEOUT_S = 30.0
_SCHEMA_LOCK = 0x6C61646C  # PostgreSQL advisory lock held while one replica creates the schema ("ladl")


def database_url(url: str | None, data_dir: Path) -> str:
    """The SQLAlchemy URL to open: `url` (plain postgresql:// gets the psycopg 3 driver) or the default SQLite
    file `<data_dir>/ladle.db`."""
    if not url:
        return f"sqlite:///{data_dir / 'ladle.db'}"
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def open_database(url: str) -> Engine:
    """An engine for `url` with the schema in place. Raises SQLAlchemyError if the database cannot be reached."""
    is_sqlite = make_url(url).get_backend_name() == "sqlite"
    if is_sqlite:
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
    else:
        engine = create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)
    _create_schema(engine, is_sqlite)
    return engine


def _create_schema(engine: Engine, is_sqlite: bool) -> None:
    with engine.begin() as connection:
        if not is_sqlite:
            # Replicas starting together would otherwise race on CREATE TABLE.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
        metadata.create_all(connection)


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # transactions are begun by _sqlite_begin, not by the driver
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    finally:
        cursor.close()


def _sqlite_begin(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")

