"""The mounts of this process's mount namespace, as /proc/self/mountinfo lists them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
THREAD_MOUNTINFO = Path("/proc/thread-self/mountinfo")
"""The calling thread's: its own mount namespace's after it entered one (setns, unshare)."""
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo(5): where a mount is, its filesystem, its propagation tags."""

    mount_point: str
    fs_type: str
    # "shared:N" (a member of peer group N), "master:N" (a slave of it), "unbindable", ...
    optional_fields: tuple[str, ...] = ()

    @property
    def shared(self) -> bool:
        return any(tag.startswith("shared:") for tag in self.optional_fields)

    @property
    def slave(self) -> bool:
        return any(tag.startswith("master:") for tag in self.optional_fields)

    @property
    def propagation(self) -> str:
        """ "shared", "slave" (a slave that is also shared counts as shared) or "private"."""
        return "shared" if self.shared else "slave" if self.slave else "private"


def _unescape(field: str) -> str:
    """Mount points with spaces, tabs, newlines or backslashes are written as octal escapes."""
    return _ESCAPE.sub(lambda match: chr(int(match[1], 8)), field)


def read_mounts(mountinfo: Path = MOUNTINFO) -> list[MountEntry]:
    """Every mount, in mount order (a later entry at the same point is on top of an earlier)."""
    entries = []
    for line in mountinfo.read_text().splitlines():
        left, sep, right = line.partition(" - ")
        fields, super_fields = left.split(" "), right.split(" ")
        if not sep or len(fields) < 6 or not super_fields[0]:
            continue
        entries.append(MountEntry(_unescape(fields[4]), super_fields[0], tuple(fields[6:])))
    return entries


def mount_of(path: str, mountinfo: Path = MOUNTINFO) -> MountEntry:
    """The mount ``path`` (absolute, symlinks resolved) is on: the deepest mount point that holds
    it, the topmost of those mounted there. Raises LookupError when no mount holds it."""
    found: MountEntry | None = None
    for entry in read_mounts(mountinfo):
        point = entry.mount_point
        holds = path == point or path.startswith(point.rstrip("/") + "/")
        if holds and (found is None or len(point) >= len(found.mount_point)):
            found = entry
    if found is None:
        raise LookupError(f"no mount holds {path}")
    return found
