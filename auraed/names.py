"""Values clients give in requests: names (DNS labels, "/"-separated paths of them) and durations."""

from __future__ import annotations

import re

from auraed.errors import AuraeError, ErrorKind

DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
MAX_PATH_LENGTH = 253
MAX_PATH_DEPTH = 8
# The longest grace period or timeout a request may ask for.
MAX_WAIT_MS = 10 * 60 * 1000
# "aurae"/"auraed" name the daemon's own cgroup and log source; "root" and "all" would be
# ambiguous wherever a name and a keyword meet (CLI arguments, Observe filters).
RESERVED_NAMES = frozenset({"aurae", "auraed", "root", "all"})


def validate_label(name: str, field: str) -> str:
    if not name:
        raise AuraeError(ErrorKind.INVALID_ARGUMENT, f"{field}: must not be empty")
    if not DNS_LABEL.match(name):
        raise AuraeError(
            ErrorKind.INVALID_ARGUMENT,
            f"{field}: {name[:80]!r} is not a DNS label (1-63 characters of a-z, 0-9 and '-', "
            "starting and ending with a letter or digit)",
        )
    if name in RESERVED_NAMES:
        raise AuraeError(ErrorKind.INVALID_ARGUMENT, f"{field}: {name!r} is a reserved name")
    return name


def validate_path(path: str, field: str) -> str:
    """A "/"-separated path of DNS labels, like "web/api"."""
    if len(path) > MAX_PATH_LENGTH:
        raise AuraeError(ErrorKind.INVALID_ARGUMENT, f"{field}: longer than {MAX_PATH_LENGTH} characters")
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        raise AuraeError(ErrorKind.INVALID_ARGUMENT, f"{field}: nested deeper than {MAX_PATH_DEPTH} levels")
    for part in parts:
        validate_label(part, field)
    return path


def parent_of(path: str) -> str | None:
    head, _, _ = path.rpartition("/")
    return head or None


def seconds_from_ms(value: int | None, field: str) -> float | None:
    """A grace period or timeout given in milliseconds, in seconds; None when not given."""
    if value is None:
        return None
    if value > MAX_WAIT_MS:
        raise AuraeError.invalid(field, f"at most {MAX_WAIT_MS} ms")
    return value / 1000.0
