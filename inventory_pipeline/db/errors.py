"""The project's own database errors: callers never see driver exceptions.

Each exception's docstring is its default message; messages are one line and never
carry a password or API key.
"""

from __future__ import annotations


class DatabaseError(Exception):
    """The database reported an error."""

    def __init__(self, message: str | None = None, sqlstate: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        # The server's five-character error code (None when the client detected the
        # failure itself, e.g. a refused or dropped connection): callers decide what is
        # expected by code, never by message text.
        self.sqlstate = sqlstate


class DatabaseUnavailable(DatabaseError):
    """The database server cannot be reached."""


class InvalidDatabaseUrl(DatabaseError):
    """The database URL is malformed."""


class MigrationError(DatabaseError):
    """The migrations cannot be applied."""


class SchemaBehind(MigrationError):
    """The database schema is behind; run `inventory-pipeline migrate`."""


class LockNotAvailable(DatabaseError):
    """A lock could not be taken within its timeout."""
