"""Small helpers shared across the package (pure Python: importable from core/)."""

from __future__ import annotations

import itertools

_counter = itertools.count()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(a // -b)


def random_uuid() -> str:
    import uuid

    return uuid.uuid4().hex


def next_request_id() -> str:
    """Process-unique, monotonically increasing id for requests that come without one."""
    return str(next(_counter))
