"""The project's own database errors: callers never see driver exceptions.

Each exception's docstring is its default message; messages are one line and never
carry a password or API key. A server error carries its SQLSTATE, and the states the
code branches on have a class of their own (mapped in `db.connection`), so a caller
writes `except UniqueViolation` rather than comparing codes or reading messages.
"""

from __future__ import annotations


class DatabaseError(Exception):
    """The database reported an error."""

    def __init__(self, message: str | None = None, sqlstate: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        # The server's five-character error code (None when the client detected the
        # failure itself, e.g. a refused or dropped connection).
        self.sqlstate = sqlstate
        # The constraint that refused a row, when the server named one: callers map it
        # to the rule it keeps instead of showing its name.
        self.constraint: str | None = None


class DatabaseUnavailable(DatabaseError):
    """The database server cannot be reached."""


class IdleInTransactionTimeout(DatabaseUnavailable):
    """The server ended a session left idle inside a transaction (25P03)."""


class InvalidDatabaseUrl(DatabaseError):
    """The database URL is malformed."""


class MigrationError(DatabaseError):
    """The migrations cannot be applied."""


class SchemaBehind(MigrationError):
    """The database schema is behind; run `inventory-pipeline migrate`."""


class LockNotAvailable(DatabaseError):
    """A lock could not be taken within its timeout (55P03)."""


class QueryCanceled(DatabaseError):
    """The statement was canceled (57014)."""

    # Its statement timeout ran out, or a client or an operator (`pg_cancel_backend`)
    # canceled it: the server tells the two apart only in its message. How long the
    # canceled call had run (measured by the client) lets a caller that knows the budget
    # it armed tell them apart instead.
    elapsed_ms: float | None = None


class ObjectNotInPrerequisiteState(DatabaseError):
    """The object is not in the state the statement requires (55000)."""


class ForeignKeyViolation(DatabaseError):
    """A referenced row does not exist or is still referenced (23503)."""


class UniqueViolation(DatabaseError):
    """A unique index or constraint refused a duplicate (23505)."""


class CheckViolation(DatabaseError):
    """A CHECK constraint refused a row (23514)."""


class NumericValueOutOfRange(DatabaseError):
    """A number does not fit its column or type (22003)."""


class FeatureNotSupported(DatabaseError):
    """The server does not support the statement (0A000)."""


class DeadlockDetected(DatabaseError):
    """The server chose this transaction as a deadlock victim (40P01)."""


class SerializationFailure(DatabaseError):
    """A concurrent transaction made this one unserializable (40001)."""


# Errors after which the same call may succeed: the server rolled the statement (and the
# transaction it was in) back whole, and the session goes on.
TRANSIENT = (DeadlockDetected, SerializationFailure, QueryCanceled, LockNotAvailable)
