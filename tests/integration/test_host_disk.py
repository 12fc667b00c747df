"""host-image's disk.img booted as a user boots it after ``dd``: firmware, the disk, DHCP (QEMU TCG).

One machine for the module: a copy of disk.img (sparse, grown by ``truncate`` as a bigger disk would
be) on a q35 machine, no -kernel, -initrd or -append. The disk is a SATA disk on q35's own AHCI
controller (ICH9), not virtio: the initramfs's ahci and sd_mod modules give it its /dev/sda, as a
PC's or server's SATA disk; the NIC is an Intel e1000e (its driver from the initramfs too). The
initramfs finds the root by its GPT name, PID 1 formats the blank ``aurae-data`` partition at
first boot, and the address comes from DHCP (busybox udhcpd on the test's own tap, offering the
one guest address of its /30).

The tests run in order. First boot by UEFI with Secure Boot enforced (Debian's OVMF secboot build
on a q35 with SMM, the image's own PK, KEK and db enrolled into a copy of its blank variables, with
the boot entry an owner adds: the firmware runs \\EFI\\aurae\\aurae.efi, the unified kernel image
the build signed, from the ESP): mTLS health, a cell made, then a power-off ends QEMU. Second boot,
a new QEMU on the same disk, by legacy BIOS (SeaBIOS, QEMU's default firmware: GRUB's boot.img in
the MBR, core.img in the BIOS boot partition, grub.cfg, kernel and initramfs on the ESP): the same
data partition, cell and CA. Third boot by UEFI with Secure Boot enforced and only Microsoft's
keys, as a stock machine ships (OVMF's secboot build with Debian's ``OVMF_VARS_4M.ms.fd``, no boot
entry: the firmware runs \\EFI\\BOOT\\BOOTX64.EFI, Debian's Microsoft-signed shim, which runs
Debian's signed GRUB, whose ``linux`` has shim verify Debian's kernel): the same again. Then a
power-off, and the disk is read from the outside.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.discovery import v0 as discovery_pb
from auraed.api.aurae.system import v0 as system_pb
from auraed.client import AuraeClient
from auraed.init.host import ca_fingerprint
from tests.integration.test_cells import allocate
from tests.integration.test_host_image import BOOT_TIMEOUT, CELLS, DISCOVERY, FINGERPRINT, SYSTEM, health
from tests.support.hostvm import (
    OVMF_MS_VARS,
    OVMF_SECBOOT_CODE,
    READY_MARKER,
    UKI_BOOT_ENTRY,
    Booted,
    DiskMachine,
    build_host_image,
)

pytestmark = pytest.mark.slow

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Booted[DiskMachine]]:
    assert OVMF_SECBOOT_CODE.is_file(), "Debian's ovmf is missing: run hack/setup"
    machine = DiskMachine(build_host_image(), firmware="uefi-secure-boot")
    try:
        machine.start()
        seconds = machine.wait_for(READY_MARKER, BOOT_TIMEOUT)
        kernel = machine.seen_at("Linux version")
        when = f"SERVING {seconds:.1f} s after QEMU started, kernel {kernel:.1f} s"
        print(f"disk.img by UEFI, Secure Boot: {when}")
        config = machine.client_config(tmp_path_factory.mktemp("disk-client"))
        yield Booted(machine, config, seconds)
    finally:
        machine.close()


@pytest.fixture
async def client(booted: Booted[DiskMachine]) -> AsyncIterator[AuraeClient]:
    async with booted.client() as c:
        yield c


async def test_the_disk_boots_by_uefi_with_secure_boot_and_serves_mtls(
    booted: Booted[DiskMachine], client: AuraeClient
) -> None:
    from grpc_health.v1 import health_pb2

    machine = booted.machine
    assert "-kernel" not in machine.args and "-initrd" not in machine.args
    assert str(OVMF_SECBOOT_CODE) in " ".join(machine.args)
    console = machine.console
    # The firmware enforces Secure Boot with only the image's keys: it ran the signed UKI by its boot
    # entry, and the kernel saw Secure Boot on (and locked itself down; the initramfs's modules are
    # Debian's, signed).
    assert f'BdsDxe: starting Boot0000 "file aurae.efi" from {UKI_BOOT_ENTRY}' in console
    assert "aurae-grub:" not in console  # no GRUB, no shim: the UKI's own built-in command line
    assert "secureboot: Secure boot enabled" in console
    assert "Kernel is locked down from EFI Secure Boot;" in console
    assert "Loaded X.509 cert 'auraed host image db: " in console  # db, read back by the kernel
    assert "warning: cannot load module" not in console
    assert "auraed.root=PARTLABEL=aurae-root" in console.split("Command line:", 1)[1].split("\n", 1)[0]
    assert "ahci 0000:00:1f.2: AHCI " in console and "QEMU HARDDISK" in console  # SATA, by ahci.ko
    assert "aurae-initramfs: root /dev/sda2 (erofs)" in console
    assert "e1000e: Intel(R) PRO/1000 Network Driver" in console  # the NIC, by e1000e.ko
    assert f"aurae-dhcp: eth0 {machine.address}/" in console  # the lease, not ip=
    assert booted.config.address == f"{machine.address}:8443"
    assert await health(client) == health_pb2.HealthCheckResponse.SERVING
    reply = await client.call(DISCOVERY, "Discover", discovery_pb.DiscoveryServiceDiscoverRequest())
    assert reply.role == "host"
    assert "/dev/sda3 (partition aurae-data, formatted this boot) on /var/lib/aurae" in console
    assert "data partition /dev/sda3 grown to the end of sda" in console  # the copy is bigger
    assert FINGERPRINT.findall(console) == [ca_fingerprint(booted.config.ca_crt.read_bytes())]


async def test_power_off_ends_qemu(booted: Booted[DiskMachine], client: AuraeClient) -> None:
    machine = booted.machine
    await allocate(client, "kept", pids=cells_pb.PidsController(max=20))
    request = system_pb.SystemServiceShutdownRequest(reason="test power-off")
    assert (await client.call(SYSTEM, "Shutdown", request)).then == "poweroff"
    assert await asyncio.to_thread(machine.wait_exit, 90) == 0
    assert "powering off" in machine.console


async def test_the_disk_boots_by_bios_with_the_same_state_and_pki(booted: Booted[DiskMachine]) -> None:
    machine = booted.machine
    mark = machine.mark()
    machine.boot("bios")
    ready = machine.wait_for(READY_MARKER, BOOT_TIMEOUT, since=mark)
    kernel = machine.seen_at("Linux version", since=mark)
    print(
        f"disk.img by BIOS (SeaBIOS, GRUB): SERVING {ready:.1f} s after QEMU started, kernel {kernel:.1f} s"
    )
    assert "-drive" in machine.args and "if=pflash" not in " ".join(machine.args)
    after = machine.console[mark:]
    assert "BdsDxe" not in after  # no UEFI this time
    assert "aurae-grub: booting /aurae/vmlinuz (BIOS)" in after  # grub.cfg, on the serial console
    await same_machine_as_before(booted, after)


async def test_the_disk_boots_by_shim_with_microsofts_keys_and_the_same_state(
    booted: Booted[DiskMachine],
) -> None:
    machine = booted.machine
    await power_off(booted)
    assert OVMF_MS_VARS.is_file(), "Debian's ovmf is missing: run hack/setup"
    mark = machine.mark()
    machine.boot("uefi-microsoft")
    ready = machine.wait_for(READY_MARKER, BOOT_TIMEOUT, since=mark)
    kernel = machine.seen_at("Linux version", since=mark)
    print(
        "disk.img by UEFI, Secure Boot with Microsoft's keys (shim, GRUB): "
        f"SERVING {ready:.1f} s after QEMU started, kernel {kernel:.1f} s"
    )
    args = " ".join(machine.args)
    assert str(OVMF_SECBOOT_CODE) in args and "vars-microsoft.fd" in args and "smm=on" in args
    after = machine.console[mark:]
    # No boot entry: the firmware ran the removable-media path, shim (signed by Microsoft's UEFI
    # CA, in db); shim ran Debian's GRUB (signed by Debian's CA, shim's own), whose grub.cfg is
    # \EFI\debian\grub.cfg; GRUB had shim verify the kernel (Debian-signed) before booting it.
    assert 'BdsDxe: starting Boot0001 "UEFI QEMU HARDDISK ' in after
    assert "file aurae.efi" not in after
    assert "aurae-grub: booting /aurae/vmlinuz (UEFI, shim)" in after
    assert "EFI stub: UEFI Secure Boot is enabled." in after
    assert "secureboot: Secure boot enabled" in after
    assert "Kernel is locked down from EFI Secure Boot;" in after
    assert "Loaded X.509 cert 'Microsoft Corporation UEFI CA 2011: " in after  # db: Microsoft's
    assert "Loaded X.509 cert 'auraed host image db: " not in after  # and not ours
    assert "Loaded X.509 cert 'Debian Secure Boot CA: " in after  # shim's, passed on (MokListRT)
    assert "warning: cannot load module" not in after
    await same_machine_as_before(booted, after)


async def power_off(booted: Booted[DiskMachine]) -> None:
    async with booted.client() as client:
        request = system_pb.SystemServiceShutdownRequest(reason="test power-off")
        assert (await client.call(SYSTEM, "Shutdown", request)).then == "poweroff"
    assert await asyncio.to_thread(booted.machine.wait_exit, 90) == 0


async def test_power_off_again_and_the_disk_holds_the_data(booted: Booted[DiskMachine]) -> None:
    machine = booted.machine
    await power_off(booted)
    # From the outside: the root partition is rootfs.img byte for byte, the data one ext4 AURAE-DATA
    # filling the grown disk, the GPT valid with its backup at the new end, and sector 0 GRUB's
    # boot code still, around the protective MBR the first boot resized.
    layout = read_layout(machine.image)
    rootfs = (machine.image / "rootfs.img").read_bytes()
    data = layout["aurae-data"]["offset"]
    with machine.disk.open("rb") as disk:
        mbr = disk.read(512)
        disk.seek(layout["aurae-root"]["offset"])
        assert hashlib.sha256(disk.read(len(rootfs))).digest() == hashlib.sha256(rootfs).digest()
        disk.seek(data + 1024)
        superblock = disk.read(1024)
    assert superblock[0x78:0x88].rstrip(b"\0") == b"AURAE-DATA"
    blocks, log_size = (
        struct.unpack_from("<I", superblock, 4)[0],
        struct.unpack_from("<I", superblock, 0x18)[0],
    )
    size = machine.disk.stat().st_size
    assert size - 2 * MIB < data + blocks * (1024 << log_size) <= size
    boot_img = (machine.image / "disk.img").open("rb").read(512)
    assert mbr[:0x1B8] == boot_img[:0x1B8] and mbr[0x1FE:] == b"\x55\xaa"
    assert mbr[0x1C2] == 0xEE and struct.unpack_from("<I", mbr, 0x1CA)[0] == size // 512 - 1
    check = subprocess.run(
        ["sgdisk", "--verify", str(machine.disk)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0 and "No problems found" in check.stdout, check.stdout + check.stderr


def read_manifest(image: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((image / "manifest.json").read_text())
    return manifest


def read_layout(image: Path) -> dict[str, dict[str, int]]:
    partitions: dict[str, dict[str, int]] = read_manifest(image)["disk"]["partitions"]
    return partitions


async def same_machine_as_before(booted: Booted[DiskMachine], after: str) -> None:
    """A later boot of the disk (console ``after``): GRUB's command line, the same root and data
    partition, not formatted again, the same CA (the first boot's client config still works) and
    the cell made then."""
    command_line = after.split("Command line:", 1)[1].split("\n", 1)[0].strip()
    assert (
        command_line == f"BOOT_IMAGE=/aurae/vmlinuz {read_manifest(booted.machine.image)['disk']['cmdline']}"
    )
    assert "aurae-initramfs: root /dev/sda2 (erofs)" in after
    assert "formatted this boot" not in after and "grown" not in after
    assert "/dev/sda3 (label AURAE-DATA) on /var/lib/aurae" in after
    assert FINGERPRINT.findall(after) == [ca_fingerprint(booted.config.ca_crt.read_bytes())]
    async with booted.client() as again:
        listed = await again.call(CELLS, "List", cells_pb.CellServiceListRequest())
        assert "kept" in {node.cell.name for node in listed.cells}
