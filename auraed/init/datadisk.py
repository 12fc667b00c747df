"""The host image's data disk: found by its ext4 label or its disk serial, formatted only when blank.

A machine booted from the host image keeps its state (the SQLite store, images, the PKI) on one
disk. PID 1 looks for it before the daemon starts:

1. a block device (whole disk or partition) holding an ext4 file system labelled ``label``
   (what a previous boot made, or what the operator made with ``mkfs.ext4 -L``);
2. else the GPT partition named ``partname`` (host-image's disk.img has one, blank), or the
   whole disk whose serial is ``serial`` (virtio-blk's ``serial=``, an NVMe or SCSI disk's
   ``serial`` or ``device/serial`` in sysfs): formatted ext4 with ``label`` -- but only when its
   first MiB is all zeros, so that no partition table or file system of anyone's is ever
   overwritten (a partition or disk that holds something else is reported and left alone).

Then it is mounted on the state directory (nosuid, nodev) and that directory made owner-only.
Stdlib only apart from ``mkfs.ext4`` (e2fsprogs, in the host image).
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import NamedTuple

log = logging.getLogger("auraed.pid1")

EXT4_SUPER_OFFSET = 1024
EXT4_MAGIC_OFFSET = 0x38
EXT4_MAGIC = b"\x53\xef"
EXT4_LABEL_OFFSET = 0x78
EXT4_LABEL_SIZE = 16
BLANK_BYTES = 1024 * 1024
MKFS_TIMEOUT = 300.0
MS_NOSUID = 0x2
MS_NODEV = 0x4


class DataDisk(NamedTuple):
    device: str
    how: str  # "label AURAE-DATA" or "serial aurae-data"
    formatted: bool  # made blank -> ext4 by this boot


class DataDiskError(Exception):
    pass


def ext4_label(device: str) -> str | None:
    """The label of the ext4 (or ext2/3) file system on ``device``; None when it holds none."""
    try:
        with open(device, "rb") as handle:
            handle.seek(EXT4_SUPER_OFFSET)
            block = handle.read(EXT4_LABEL_OFFSET + EXT4_LABEL_SIZE)
    except OSError:
        return None
    if block[EXT4_MAGIC_OFFSET : EXT4_MAGIC_OFFSET + 2] != EXT4_MAGIC:
        return None
    return block[EXT4_LABEL_OFFSET:].split(b"\0", 1)[0].decode(errors="replace")


def is_blank(device: str, size: int = BLANK_BYTES) -> bool:
    with open(device, "rb") as handle:
        data = handle.read(size)
    return len(data) > 0 and data.count(0) == len(data)


def block_devices(sys_dir: str = "/sys") -> list[tuple[str, str]]:
    """(name, sysfs directory) of every disk and partition, disks first; loop, ram and zram
    devices left out."""
    found: list[tuple[str, str]] = []
    try:
        disks = sorted(os.listdir(f"{sys_dir}/block"))
    except OSError:
        return found
    for disk in disks:
        if disk.startswith(("loop", "ram", "zram", "sr", "fd")):
            continue
        directory = f"{sys_dir}/block/{disk}"
        found.append((disk, directory))
        try:
            children = sorted(os.listdir(directory))
        except OSError:
            continue
        found += [(c, f"{directory}/{c}") for c in children if c.startswith(disk)]
    return found


def disk_serial(directory: str) -> str:
    for name in ("serial", "device/serial"):
        try:
            with open(f"{directory}/{name}") as handle:
                return handle.read().strip().strip("\0").strip()
        except OSError:
            continue
    return ""


def partition_name(directory: str) -> str:
    """The GPT name of the partition at sysfs ``directory`` (its uevent's PARTNAME); "" if none."""
    try:
        with open(f"{directory}/uevent") as handle:
            for line in handle:
                if line.startswith("PARTNAME="):
                    return line.removeprefix("PARTNAME=").rstrip("\n")
    except OSError:
        pass
    return ""


def find(
    label: str, serial: str, sys_dir: str = "/sys", dev_dir: str = "/dev", partname: str = ""
) -> tuple[str, str] | None:
    """(device, how it was found) of the data disk; None when there is none (yet)."""
    devices = block_devices(sys_dir)
    for name, _ in devices:
        if ext4_label(f"{dev_dir}/{name}") == label:
            return f"{dev_dir}/{name}", f"label {label}"
    for name, directory in devices:
        if partname and os.path.exists(f"{directory}/partition") and partition_name(directory) == partname:
            return f"{dev_dir}/{name}", f"partition {partname}"
    for name, directory in devices:
        if serial and disk_serial(directory) == serial and os.path.exists(f"{directory}/device"):
            return f"{dev_dir}/{name}", f"serial {serial}"
    return None


def format_ext4(device: str, label: str) -> None:
    # -m 0: no blocks reserved for root (everything here is root's); the lazy init options keep a
    # first boot short on big disks (the kernel zeroes the inode tables in the background).
    args = [
        "mkfs.ext4", "-q", "-F", "-L", label, "-m", "0",
        "-E", "lazy_itable_init=1,lazy_journal_init=1", device,
    ]  # fmt: skip
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=MKFS_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataDiskError(f"mkfs.ext4 {device}: {exc}") from None
    if result.returncode != 0:
        raise DataDiskError(f"mkfs.ext4 {device} failed ({result.returncode}): {result.stderr.strip()}")


def prepare(
    label: str,
    serial: str,
    target: str,
    wait: float,
    *,
    partname: str = "",
    sys_dir: str = "/sys",
    dev_dir: str = "/dev",
) -> DataDisk:
    """Find the data disk (waiting up to ``wait`` seconds for it), format it if it is blank and
    found by partition name or serial, mount it on ``target``. DataDiskError when there is none or
    it cannot be used."""
    import time

    from auraed.system.namespaces import mount

    deadline = time.monotonic() + wait
    while (found := find(label, serial, sys_dir, dev_dir, partname)) is None:
        if time.monotonic() >= deadline:
            named = f", no partition named {partname!r}" if partname else ""
            raise DataDiskError(f"no disk labelled {label}{named} nor with serial {serial!r} in {wait:g} s")
        time.sleep(0.05)
    device, how = found
    formatted = False
    if not how.startswith("label"):
        if not is_blank(device):
            raise DataDiskError(
                f"{device} ({how}) is not blank and holds no ext4 labelled {label}: "
                "not formatting it (zero its first MiB, or label its ext4 file system, to use it)"
            )
        log.info("data disk %s (%s) is blank: formatting it ext4, label %s", device, how, label)
        format_ext4(device, label)
        formatted = True
    os.makedirs(target, mode=0o700, exist_ok=True)
    mount(device, target, "ext4", MS_NOSUID | MS_NODEV, None)
    os.chmod(target, 0o700)
    log.info("data disk %s (%s) mounted on %s%s", device, how, target, " (new)" if formatted else "")
    return DataDisk(device, how, formatted)
