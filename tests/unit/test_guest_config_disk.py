"""The guest's config disk (a squashfs image holding its key) is rebuilt in place safely."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

from auraed.pki import create_ca
from auraed.vms.guest_config import build_config_disk
from auraed.vms.guests import identity_for

SQUASHFS_MAGIC = b"hsqs"
BYTES_USED = struct.Struct("<Q")  # the superblock's bytes_used, at offset 40


def whole(data: bytes) -> bool:
    """A complete squashfs image: mksquashfs writes the superblock last."""
    return data[:4] == SQUASHFS_MAGIC and 0 < BYTES_USED.unpack_from(data, 40)[0] <= len(data)


def test_a_rebuilt_config_disk_is_whole_at_its_path_at_every_moment(tmp_path: Path) -> None:
    """A VMM may open the disk while another Start of the same VM rebuilds it."""
    ca, identity = create_ca(), identity_for("g1", "10.213.0.2/30", "10.213.0.1/30", 8443)
    output = build_config_disk(tmp_path / "config.img", identity, ca, "aurae-host")
    stop, seen = threading.Event(), []

    def watch() -> None:
        while not stop.is_set():
            try:
                seen.append(whole(output.read_bytes()))
            except FileNotFoundError:
                seen.append(False)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(5):
            build_config_disk(output, identity, ca, "aurae-host")
    finally:
        stop.set()
        watcher.join()
    assert len(seen) > 5 and all(seen), f"{seen.count(False)} of {len(seen)} reads found no whole disk"
    assert output.stat().st_mode & 0o777 == 0o600
    assert [path.name for path in tmp_path.iterdir()] == ["config.img"]  # no staging file left
