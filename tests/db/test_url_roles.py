"""A real login whose user and password hold every reserved URL character: the URL the
CLI derives reaches the same server, database and role through psycopg and through
SQLAlchemy + psycopg2 (what dagster-postgres uses)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import sqlalchemy
from psycopg import conninfo

from inventory_pipeline.db import connect, execute, fetch_one
from inventory_pipeline.db.connection import url_with_database
from inventory_pipeline.deployment import dagster_storage_url

PASSWORD = "p@ss/w:rd%?#&= ;'\"é"


@pytest.fixture
def special_role(server_url: str) -> Iterator[str]:
    name = f"ops@team:/?#%& {uuid.uuid4().hex[:8]}"
    with connect(server_url) as admin:
        row = fetch_one(
            admin,
            "SELECT format('CREATE ROLE %%I LOGIN PASSWORD %%L', %s::text, %s::text) AS ddl",
            (name, PASSWORD),
        )
        assert row is not None
        execute(admin, row["ddl"])
    try:
        yield name
    finally:
        with connect(server_url) as admin:
            row = fetch_one(admin, "SELECT format('DROP ROLE %%I', %s::text) AS ddl", (name,))
            assert row is not None
            execute(admin, row["ddl"])


def test_special_login_connects_through_both_drivers(db_url: str, special_role: str) -> None:
    params = {k: str(v) for k, v in conninfo.conninfo_to_dict(db_url).items() if v is not None}
    database = params["dbname"]
    where = (
        f"{params['host']}:{params.get('port', '5432')}/{database}"
        if not params["host"].startswith("/")
        else f"/{database}?host={quote(params['host'], safe='')}"
    )
    login = f"postgresql://{quote(special_role, safe='')}:{quote(PASSWORD, safe='')}@{where}"
    # What `provision` does: the same login, another database (here the same one).
    url = url_with_database(login, database)
    with connect(url) as conn:
        row = fetch_one(conn, "SELECT current_user AS who, current_database() AS db")
    assert row == {"who": special_role, "db": database}
    engine = sqlalchemy.create_engine(dagster_storage_url(url), poolclass=sqlalchemy.NullPool)
    try:
        with engine.connect() as alchemy:
            who, db = alchemy.execute(
                sqlalchemy.text("SELECT current_user, current_database()")
            ).one()
    finally:
        engine.dispose()
    assert (who, db) == (special_role, database)
