"""A clone's own copy of its template's RAM file, holes left holes (``python -m auraed.vms.sparse
SOURCE TARGET``, printing the bytes of data copied).

Run as a child of the daemon, started in the VMM's cgroup (a vm pod's: ``backend.in_cgroup``):
the copy's pages are charged to the cgroup of the process that writes them, and stay charged
there while the clone's QEMU maps them, so the pod cgroup, not the daemon's, pays for them. Only
the standard library: the child starts in tens of milliseconds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def copy_sparse(source: Path, target: Path) -> int:
    """``source`` copied to ``target`` (made owner-only; it must not exist), its holes left holes
    (SEEK_DATA/SEEK_HOLE, the data by copy_file_range: a reflink where the filesystem has them);
    the bytes of data copied. A failed copy leaves no ``target``."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            return _copy_data(src, dst, source)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_data(src: int, dst: int, source: Path) -> int:
    size = os.fstat(src).st_size
    os.ftruncate(dst, size)
    copied = offset = 0
    while offset < size:
        try:
            data = os.lseek(src, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        hole = os.lseek(src, data, os.SEEK_HOLE)
        position = data
        while position < hole:
            done = os.copy_file_range(src, dst, hole - position, position, position)
            if done <= 0:
                raise OSError(f"copy_file_range of {source} stopped at {position}")
            position += done
        copied += hole - data
        offset = hole
    return copied


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m auraed.vms.sparse SOURCE TARGET", file=sys.stderr)
        return 2
    try:
        print(copy_sparse(Path(argv[0]), Path(argv[1])), flush=True)
    except OSError as exc:
        print(f"sparse copy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
