"""Open the database behind files and batches, with the schema created if it is missing.

SQLite (a file under the data directory) is the default and needs nothing started; a `postgresql://` URL is
opened with psycopg 3 and lets several gateways share the state. SQLite runs in WAL mode with synchronous=FULL,
so a commit is on disk when it returns, and every transaction begins IMMEDIATE (takes the write lock at once),
so two writers queue on the busy timeout instead of failing on a lock upgrade.

A database made by an earlier version is brought up to date when it is opened: `create_all` adds missing tables,
`_add_missing_columns` the columns that newer versions added to existing tables, `_add_missing_indexes` the
indexes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateColumn

from gateway.store.tables import metadata

SQLITE_BUSY_TIMEOUT_S = 30.0
_SCHEMA_LOCK = 0x6C61646C  # PostgreSQL advisory lock held while one replica creates the schema ("ladl")
_PROJECT_LOCKS = 0x6C61646D  # the first key of the (space, project) advisory locks of `lock_project`


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
        _add_missing_columns(connection)
        _add_missing_indexes(connection)


def _add_missing_columns(connection: Connection, schema: MetaData = metadata) -> None:
    """ALTER TABLE ... ADD COLUMN for every column of `schema` that an existing table lacks, then the indexes
    that cover those columns. A NOT NULL column needs a server_default to be added to rows that exist."""
    inspector = inspect(connection)
    quote = connection.dialect.identifier_preparer
    for table in schema.sorted_tables:
        present = {column["name"] for column in inspector.get_columns(table.name)}
        missing = [column for column in table.columns if column.name not in present]
        for column in missing:
            if column.primary_key or (not column.nullable and column.server_default is None):
                raise RuntimeError(f"cannot add column {table.name}.{column.name} to an existing database: a new "
                                   "column must be nullable or have a server_default, and not be in the key")
            ddl = CreateColumn(column).compile(dialect=connection.dialect)
            connection.execute(text(f"ALTER TABLE {quote.format_table(table)} ADD COLUMN {ddl}"))


def _add_missing_indexes(connection: Connection, schema: MetaData = metadata) -> None:
    """CREATE INDEX for every index of `schema` that an existing table lacks (those over added columns, and
    indexes that newer versions added over old columns)."""
    for table in schema.sorted_tables:
        for index in table.indexes:
            index.create(connection, checkfirst=True)


def lock_project(connection: Connection, project: str) -> None:
    """Hold `project`'s lock until this transaction ends, so that checking a project limit and the insert it
    allows are one step. SQLite needs nothing: its every transaction takes the write lock when it begins."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:space, hashtext(:project))"),
                           {"space": _PROJECT_LOCKS, "project": project})


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

