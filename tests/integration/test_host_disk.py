"""host-image's disk.img booted as a user boots it after ``dd``: UEFI firmware, the disk, DHCP (QEMU TCG).

One machine for the module, booted from a copy of disk.img (sparse, grown by ``truncate`` as a
bigger disk would be) by Debian's OVMF on a q35 machine: no -kernel, -initrd or -append, so the
firmware finds \\EFI\\BOOT\\BOOTX64.EFI (the unified kernel image) on the ESP. The disk is a SATA
disk on q35's own AHCI controller (ICH9), not virtio: the initramfs's ahci and sd_mod modules give
it its /dev/sda, as a PC's or server's SATA disk. The initramfs finds the root by its GPT name,
PID 1 formats the blank ``aurae-data`` partition, and the address comes from DHCP (busybox
udhcpd on the test's own tap, offering the one guest address of its /30). The tests run in order:
mTLS health, a cell kept across a SystemService reboot (the same QEMU: a reset, firmware again),
power-off ending QEMU; then the disk is read from the outside.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.discovery import v0 as discovery_pb
from auraed.api.aurae.system import v0 as system_pb
from auraed.client import AuraeClient
from auraed.init.host import ca_fingerprint
from tests.integration.test_cells import allocate
from tests.integration.test_host_image import BOOT_TIMEOUT, CELLS, DISCOVERY, FINGERPRINT, SYSTEM, health
from tests.support.hostvm import READY_MARKER, Booted, HostMachine, build_host_image

pytestmark = pytest.mark.slow

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
GROW = 512 * 1024 * 1024  # the copy is a disk bigger than the image, as a real one is
MIB = 1024 * 1024


class DiskMachine(HostMachine):
    """HostMachine's tap, console and clean-up; booted from disk.img by OVMF, addressed by DHCP."""

    def __init__(self, image: Path) -> None:
        super().__init__(image, data_mib=1, static_ip=False)
        self.data_disk.unlink()  # HostMachine's separate data disk: the partition is the data disk here
        self.disk = self.root / "disk.img"
        subprocess.run(["cp", "--sparse=always", str(image / "disk.img"), str(self.disk)], check=True)
        with self.disk.open("r+b") as handle:
            handle.truncate(self.disk.stat().st_size + GROW)
        shutil.copy(OVMF_VARS, self.root / "vars.fd")
        self.udhcpd: subprocess.Popen[bytes] | None = None
        self.args = [
            "qemu-system-x86_64",
            "-M", "q35", "-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio",
            "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,unit=1,file={self.root / 'vars.fd'}",
            "-drive", f"id=disk,file={self.disk},format=raw,if=none",
            "-device", "ide-hd,drive=disk,bus=ide.0",  # SATA port 0 of q35's ICH9 AHCI
            "-netdev", f"tap,id=net0,ifname={self.net.tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=net0,mac={self.net.mac}",
            "-object", "rng-random,id=rng0,filename=/dev/urandom",
            "-device", "virtio-rng-pci,rng=rng0",
        ]  # fmt: skip

    def start(self) -> None:
        mask = ipaddress.IPv4Network(f"0.0.0.0/{self.net.prefixlen}").netmask
        conf = self.root / "udhcpd.conf"
        conf.write_text(
            f"start {self.net.guest_ip}\nend {self.net.guest_ip}\nmax_leases 1\n"
            f"interface {self.net.tap}\nlease_file {self.root / 'udhcpd.leases'}\n"
            f"pidfile {self.root / 'udhcpd.pid'}\n"
            f"option subnet {mask}\noption router {self.net.host_ip}\noption lease 3600\n"
        )
        (self.root / "udhcpd.leases").touch()
        self.udhcpd = subprocess.Popen(
            ["busybox", "udhcpd", "-f", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(self.root / "udhcpd.log").open("wb"),
        )
        super().start()

    def close(self) -> None:
        if self.udhcpd is not None:
            self.udhcpd.kill()
            self.udhcpd.wait()
        super().close()


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Booted[DiskMachine]]:
    assert OVMF_CODE.is_file(), "Debian's ovmf is missing: run hack/setup"
    machine = DiskMachine(build_host_image())
    try:
        machine.start()
        seconds = machine.wait_for(READY_MARKER, BOOT_TIMEOUT)
        kernel = machine.seen_at("Linux version")
        print(f"disk.img: boot to SERVING {seconds:.1f} s after QEMU started (TCG; firmware {kernel:.1f} s)")
        config = machine.client_config(tmp_path_factory.mktemp("disk-client"))
        yield Booted(machine, config, seconds)
    finally:
        machine.close()


@pytest.fixture
async def client(booted: Booted[DiskMachine]) -> AsyncIterator[AuraeClient]:
    async with booted.client() as c:
        yield c


async def test_the_disk_boots_by_uefi_and_serves_mtls(
    booted: Booted[DiskMachine], client: AuraeClient
) -> None:
    from grpc_health.v1 import health_pb2

    machine = booted.machine
    assert "-kernel" not in machine.args and "-initrd" not in machine.args
    console = machine.console
    assert "auraed.root=PARTLABEL=aurae-root" in console.split("Command line:", 1)[1].split("\n", 1)[0]
    assert "ahci 0000:00:1f.2: AHCI " in console and "QEMU HARDDISK" in console  # SATA, by ahci.ko
    assert "aurae-initramfs: root /dev/sda2 (erofs)" in console
    assert f"aurae-dhcp: eth0 {machine.address}/" in console  # the lease, not ip=
    assert booted.config.address == f"{machine.address}:8443"
    assert await health(client) == health_pb2.HealthCheckResponse.SERVING
    reply = await client.call(DISCOVERY, "Discover", discovery_pb.DiscoveryServiceDiscoverRequest())
    assert reply.role == "host"
    assert "/dev/sda3 (partition aurae-data, formatted this boot) on /var/lib/aurae" in console
    assert "data partition /dev/sda3 grown to the end of sda" in console  # the copy is bigger
    assert FINGERPRINT.findall(console) == [ca_fingerprint(booted.config.ca_crt.read_bytes())]


async def test_the_data_partition_keeps_state_across_a_reboot(
    booted: Booted[DiskMachine], client: AuraeClient
) -> None:
    machine = booted.machine
    await allocate(client, "kept", pids=cells_pb.PidsController(max=20))
    mark = machine.mark()
    request = system_pb.SystemServiceShutdownRequest(reason="test reboot", reboot=True)
    assert (await client.call(SYSTEM, "Shutdown", request)).then == "reboot"
    machine.wait_for("rebooting", 60, since=mark)
    ready = machine.wait_for(READY_MARKER, BOOT_TIMEOUT, since=mark)
    rebooted = machine.seen_at("Linux version", since=mark)
    print(f"disk.img: reboot, kernel {rebooted:.1f} s, SERVING {ready:.1f} s after QEMU started")
    after = machine.console[mark:]
    assert "BdsDxe: starting" in after  # the firmware booted the disk again
    assert "formatted this boot" not in after
    assert "/dev/sda3 (label AURAE-DATA) on /var/lib/aurae" in after
    assert machine.process is not None and machine.process.poll() is None  # the same QEMU
    async with booted.client() as again:  # the first boot's client config: the same CA
        listed = await again.call(CELLS, "List", cells_pb.CellServiceListRequest())
        assert "kept" in {node.cell.name for node in listed.cells}


async def test_power_off_ends_qemu_and_the_disk_holds_the_data(
    booted: Booted[DiskMachine], client: AuraeClient
) -> None:
    machine = booted.machine
    request = system_pb.SystemServiceShutdownRequest(reason="test power-off")
    assert (await client.call(SYSTEM, "Shutdown", request)).then == "poweroff"
    assert await asyncio.to_thread(machine.wait_exit, 90) == 0
    assert "powering off" in machine.console
    # From the outside: the root partition is rootfs.img byte for byte, the data one ext4 AURAE-DATA
    # filling the grown disk, and the GPT valid with its backup at the new end.
    layout = read_layout(machine.image)
    rootfs = (machine.image / "rootfs.img").read_bytes()
    data = layout["aurae-data"]["offset"]
    with machine.disk.open("rb") as disk:
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
    check = subprocess.run(
        ["sgdisk", "--verify", str(machine.disk)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0 and "No problems found" in check.stdout, check.stdout + check.stderr


def read_layout(image: Path) -> dict[str, dict[str, int]]:
    import json

    manifest = json.loads((image / "manifest.json").read_text())
    partitions: dict[str, dict[str, int]] = manifest["disk"]["partitions"]
    return partitions
