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


_BYTE_UNITS = {
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "b": 1,
}


def parse_bytes(text: str | int) -> int:
    """`2GiB`, `512MiB`, `1.5g`, `1000` -> bytes."""
    if isinstance(text, int):
        return text
    t = str(text).strip().lower()
    for suffix in sorted(_BYTE_UNITS, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * _BYTE_UNITS[suffix])
    return int(t)


def json_object(value: object, what: str) -> dict | None:
    """A dict given as itself or as JSON text (CLI flags, HTTP fields); None stays None. ValueError names `what`."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict or a JSON object, got {type(value).__name__}")
    return value
