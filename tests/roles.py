"""Writer roles for tests: other programs write the data contract under roles of their
own, granted rights on those tables and nothing else.

Roles are cluster-wide (they outlive the test's database), so each one gets a unique
name and is dropped on the way out, whatever happened in the test.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator

from inventory_pipeline.db import Connection, connect, execute, transaction

ITEM_RIGHTS = "SELECT, INSERT, UPDATE, DELETE"
_RIGHTS = re.compile(r"^[A-Z]+(, [A-Z]+)*$")


@contextlib.contextmanager
def writer_role(db_url: str, items: str = ITEM_RIGHTS, libraries: str = "SELECT") -> Iterator[str]:
    """A NOLOGIN role with `items` on media_server_items, `libraries` on libraries, SELECT
    on media_servers and USAGE on the sequences, as a writer program is given."""
    assert _RIGHTS.match(items) and _RIGHTS.match(libraries)  # fixed lists, never input
    name = f"test_writer_{uuid.uuid4().hex[:16]}"
    with connect(db_url) as admin:
        execute(admin, f"CREATE ROLE {name} NOLOGIN")
        try:
            execute(admin, f"GRANT {items} ON media_server_items TO {name}")
            execute(admin, f"GRANT {libraries} ON libraries TO {name}")
            execute(admin, f"GRANT SELECT ON media_servers TO {name}")
            execute(admin, f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {name}")
            yield name
        finally:
            execute(admin, f"DROP OWNED BY {name}")  # its grants in this database
            execute(admin, f"DROP ROLE {name}")


@contextlib.contextmanager
def acting_as(conn: Connection, role: str) -> Iterator[Connection]:
    """One transaction run as `role` (SET LOCAL: the role ends with the transaction)."""
    assert re.match(r"^[a-z_0-9]+$", role)
    with transaction(conn):
        execute(conn, f"SET LOCAL ROLE {role}")
        yield conn
