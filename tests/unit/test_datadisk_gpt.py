"""The data disk as a GPT partition (host-image's disk.img): found by its name, formatted only
blank, grown to the end of a disk bigger than the image -- on real files partitioned by sgdisk."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from auraed.init import datadisk

MIB = 1024 * 1024


def gpt_disk(path: Path, mib: int) -> None:
    with path.open("wb") as handle:
        handle.truncate(mib * MIB)
    subprocess.run(
        ["sgdisk", "--clear", "--new=1:1M:+4M", "--change-name=1:aurae-root",
         "--new=2:0:0", "--change-name=2:aurae-data", str(path)],
        check=True, capture_output=True,
    )  # fmt: skip


def partitions(path: Path) -> list[tuple[int, int, str]]:
    out = subprocess.run(["sgdisk", "--print", str(path)], check=True, capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines()]
    return [(int(r[1]), int(r[2]), r[-1]) for r in rows if len(r) >= 7 and r[0].isdigit()]


def verify(path: Path) -> str:
    result = subprocess.run(["sgdisk", "--verify", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_grown_disk_s_last_partition_is_extended_and_the_gpt_stays_valid(tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    gpt_disk(disk, 64)
    assert datadisk.grow_gpt(str(disk), 2) is None  # the disk is as big as its GPT says
    with disk.open("r+b") as handle:
        handle.truncate(200 * MIB)  # dd'd to a bigger disk
    first, last = datadisk.grow_gpt(str(disk), 2) or (0, 0)
    assert (last + 1) % 2048 == 0
    assert partitions(disk) == [(2048, 10239, "aurae-root"), (first, last, "aurae-data")]
    assert (last + 1) * 512 == 199 * MIB  # the last MiB holds the backup GPT
    assert "No problems found" in verify(disk)
    assert datadisk.grow_gpt(str(disk), 2) is None  # done once
    with disk.open("r+b") as handle:
        handle.truncate(300 * MIB)
    with pytest.raises(datadisk.DataDiskError, match="not the last"):
        datadisk.grow_gpt(str(disk), 1)  # the root is never moved or grown
    assert partitions(disk)[0] == (2048, 10239, "aurae-root")


def test_a_corrupt_gpt_is_left_alone(tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    gpt_disk(disk, 64)
    with disk.open("r+b") as handle:
        handle.truncate(128 * MIB)
        handle.seek(512 + 40)
        handle.write(b"\xff")  # first usable LBA: the header's CRC no longer matches
    before = disk.read_bytes()[: 64 * MIB]
    with pytest.raises(datadisk.DataDiskError, match="CRC"):
        datadisk.grow_gpt(str(disk), 2)
    assert disk.read_bytes()[: 64 * MIB] == before


def fake_partition(root: Path, disk: str, number: int, partname: str, size: int = 32 * MIB) -> Path:
    """/sys/block/<disk>/<disk><n> with a GPT name in its uevent, and /dev/<disk><n>, a sparse file."""
    name = f"{disk}{number}"
    directory = root / "sys/block" / disk / name
    directory.mkdir(parents=True)
    (directory / "partition").write_text(f"{number}\n")
    (directory / "uevent").write_text(f"MAJOR=254\nMINOR={number}\nDEVNAME={name}\nDEVTYPE=partition\n"
                                      f"PARTN={number}\nPARTNAME={partname}\n")  # fmt: skip
    (root / "dev").mkdir(exist_ok=True)
    device = root / "dev" / name
    with device.open("wb") as handle:
        handle.truncate(size)
    return device


def test_the_data_partition_is_found_by_its_gpt_name_and_formatted_only_when_blank(tmp_path: Path) -> None:
    fake_partition(tmp_path, "vda", 2, "aurae-root")
    data = fake_partition(tmp_path, "vda", 3, "aurae-data")
    sys_dir, dev_dir = str(tmp_path / "sys"), str(tmp_path / "dev")
    assert datadisk.find("AURAE-DATA", "aurae-data", sys_dir, dev_dir) is None  # no serial, no name given
    found = datadisk.find("AURAE-DATA", "", sys_dir, dev_dir, partname="aurae-data")
    assert found == (str(data), "partition aurae-data")
    # A partition with the name that holds anything is never formatted.
    with data.open("r+b") as handle:
        handle.seek(1024)
        handle.write(b"anything")
    with pytest.raises(datadisk.DataDiskError, match="not blank"):
        datadisk.prepare(
            "AURAE-DATA",
            "",
            str(tmp_path / "mnt"),
            0.1,
            partname="aurae-data",
            sys_dir=sys_dir,
            dev_dir=dev_dir,
        )
    assert data.read_bytes()[: 1024 + 8] == b"\0" * 1024 + b"anything"
    # Once labelled, the label finds it first.
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "AURAE-DATA", str(data)], check=True)
    assert datadisk.find("AURAE-DATA", "", sys_dir, dev_dir, partname="aurae-data") == (
        str(data),
        "label AURAE-DATA",
    )
