"""Names clients give to things: DNS labels, and "/"-separated paths of them."""

from __future__ import annotations

import re

from auraed.errors import AuraeError, ErrorKind

DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
MAX_PATH_LENGTH = 253
MAX_PATH_DEPTH = 8
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
