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

import fcntl
import logging
import os
import struct
import subprocess
import zlib
from typing import BinaryIO, NamedTuple

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


GPT_SIGNATURE = b"EFI PART"
GPT_HEADER = struct.Struct("<8sIIIIQQQQ16sQIII")  # through the partition entries' CRC
GPT_ENTRY = struct.Struct("<16s16sQQQ72s")
BLKPG = 0x1269
BLKPG_RESIZE_PARTITION = 3
BLKPG_PARTITION = struct.Struct("<qqi64s64s4x")  # start, length (bytes), pno, devname, volname
BLKPG_ARG = struct.Struct("<iii4xQ")  # op, flags, datalen, data (a pointer)


class Gpt(NamedTuple):
    header: bytes  # the primary header, header_size bytes
    fields: tuple[object, ...]
    entries: bytearray


def read_gpt(handle: BinaryIO, sector: int) -> Gpt:
    handle.seek(sector)
    raw = handle.read(sector)
    fields = GPT_HEADER.unpack_from(raw)
    signature, _, size, crc = fields[0], fields[1], fields[2], fields[3]
    if signature != GPT_SIGNATURE or not GPT_HEADER.size <= size <= sector:
        raise DataDiskError("no GPT header")
    if zlib.crc32(raw[:16] + b"\0\0\0\0" + raw[20:size]) != crc:
        raise DataDiskError("the GPT header's CRC does not match")
    entries_lba, count, entry_size, entries_crc = fields[10], fields[11], fields[12], fields[13]
    assert isinstance(entries_lba, int) and isinstance(count, int) and isinstance(entry_size, int)
    if entry_size < GPT_ENTRY.size or count * entry_size > 1024 * 1024:
        raise DataDiskError("implausible GPT partition entries")
    handle.seek(entries_lba * sector)
    entries = bytearray(handle.read(count * entry_size))
    if zlib.crc32(entries) != entries_crc:
        raise DataDiskError("the GPT partition entries' CRC does not match")
    return Gpt(raw[:size], fields, entries)


GPT_FIELDS = {"current": 5, "backup": 6, "last_usable": 8, "entries_lba": 10, "entries_crc": 13}


def _header(gpt: Gpt, **changes: int) -> bytes:
    fields = list(gpt.fields)
    fields[3] = 0
    for name, value in changes.items():
        fields[GPT_FIELDS[name]] = value
    raw = bytearray(gpt.header)
    GPT_HEADER.pack_into(raw, 0, *fields)
    struct.pack_into("<I", raw, 16, zlib.crc32(raw))
    return bytes(raw)


def grow_gpt(disk: str, number: int, sector: int = 512) -> tuple[int, int] | None:
    """Extend partition ``number`` of the GPT disk ``disk`` (a device or an image file) to the
    disk's end when it is the last partition and the disk is bigger than its GPT says (an image
    written to a bigger disk): the backup GPT moved to the end, both headers and the protective
    MBR rewritten. (first, last) sector of the grown partition; None when there is nothing to do."""
    with open(disk, "r+b") as handle:
        total = handle.seek(0, os.SEEK_END) // sector
        gpt = read_gpt(handle, sector)
        backup, last_usable, count, entry_size = gpt.fields[6], gpt.fields[8], gpt.fields[11], gpt.fields[12]
        assert isinstance(backup, int) and isinstance(last_usable, int)
        assert isinstance(count, int) and isinstance(entry_size, int)
        if backup >= total - 1:
            return None
        if not 1 <= number <= count:
            raise DataDiskError(f"no partition {number} in the GPT")
        ends = []
        for index in range(count):
            entry = GPT_ENTRY.unpack_from(gpt.entries, index * entry_size)
            if entry[0] != bytes(16):
                ends.append(entry[3])
        offset = (number - 1) * entry_size
        kind, unique, first, last, attributes, name = GPT_ENTRY.unpack_from(gpt.entries, offset)
        if kind == bytes(16) or last != max(ends) or last > last_usable:
            raise DataDiskError(f"partition {number} is not the last on the disk")
        entry_sectors = -(-count * entry_size // sector)
        backup_entries = total - 1 - entry_sectors
        align = max(1, BLANK_BYTES // sector)  # the end on a MiB, as partitioning tools like it
        new_last = max(last, (backup_entries // align) * align - 1)
        GPT_ENTRY.pack_into(gpt.entries, offset, kind, unique, first, new_last, attributes, name)
        crc = zlib.crc32(gpt.entries)
        entries = bytes(gpt.entries).ljust(entry_sectors * sector, b"\0")
        primary = _header(gpt, backup=total - 1, last_usable=new_last, entries_crc=crc)
        secondary = _header(
            gpt,
            current=total - 1,
            backup=1,
            last_usable=new_last,
            entries_lba=backup_entries,
            entries_crc=crc,
        )
        # The old backup (now inside the grown partition) zeroed, the new one written, then the
        # primary: a disk cut off half way still has one valid GPT.
        handle.seek((backup - entry_sectors) * sector)
        handle.write(bytes((entry_sectors + 1) * sector))
        handle.seek(backup_entries * sector)
        handle.write(entries + secondary.ljust(sector, b"\0"))
        handle.flush()
        os.fsync(handle.fileno())
        handle.seek(2 * sector)
        handle.write(entries)
        handle.seek(sector)
        handle.write(primary)
        handle.seek(446 + 12)  # the protective MBR's partition: its size in sectors
        handle.write(struct.pack("<I", min(total - 1, 0xFFFFFFFF)))
        handle.flush()
        os.fsync(handle.fileno())
    return first, new_last


def grow_partition(device: str, sys_dir: str = "/sys", dev_dir: str = "/dev") -> bool:
    """Grow the partition ``device`` (blank, the data disk's) to the end of its disk and tell the
    kernel (BLKPG: the disk's other partitions, the root among them, stay mounted); False when
    there was nothing to grow. DataDiskError when it cannot be done."""
    name = os.path.basename(device)
    directory = os.path.realpath(f"{sys_dir}/class/block/{name}")
    disk = os.path.basename(os.path.dirname(directory))
    try:
        number = int(_read_sys(f"{directory}/partition"))
        sector = int(_read_sys(f"{sys_dir}/block/{disk}/queue/logical_block_size"))
    except (OSError, ValueError) as exc:
        raise DataDiskError(f"{device}: cannot read its partition number: {exc}") from None
    grown = grow_gpt(f"{dev_dir}/{disk}", number, sector)
    if grown is None:
        return False
    first, last = grown
    import ctypes

    partition = ctypes.create_string_buffer(
        BLKPG_PARTITION.pack(first * sector, (last - first + 1) * sector, number, b"", b"")
    )
    arg = BLKPG_ARG.pack(BLKPG_RESIZE_PARTITION, 0, BLKPG_PARTITION.size, ctypes.addressof(partition))
    descriptor = os.open(f"{dev_dir}/{disk}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(descriptor, BLKPG, arg)
    except OSError as exc:
        raise DataDiskError(f"the kernel did not take {device}'s new size: {exc}") from None
    finally:
        os.close(descriptor)
    log.info(
        "data partition %s grown to the end of %s: %d MiB", device, disk, (last - first + 1) * sector >> 20
    )
    return True


def _read_sys(path: str) -> str:
    with open(path) as handle:
        return handle.read().strip()


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
        if how.startswith("partition"):
            try:
                grow_partition(device, sys_dir, dev_dir)
            except (DataDiskError, OSError) as exc:
                log.warning("data partition %s not grown (%s): formatting it as it is", device, exc)
        log.info("data disk %s (%s) is blank: formatting it ext4, label %s", device, how, label)
        format_ext4(device, label)
        formatted = True
    os.makedirs(target, mode=0o700, exist_ok=True)
    mount(device, target, "ext4", MS_NOSUID | MS_NODEV, None)
    os.chmod(target, 0o700)
    log.info("data disk %s (%s) mounted on %s%s", device, how, target, " (new)" if formatted else "")
    return DataDisk(device, how, formatted)
