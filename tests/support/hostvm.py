"""A machine booted from the host image under QEMU (TCG), the way an operator boots a server.

``HostMachine`` boots ``host-image/build``'s kernel + initramfs with its root image and a data disk
(the kernel: ``vmlinux``, the ELF image out of ``vmlinuz``, by its PVH entry point: the bzImage's
XZ decompression would add ~10 s to every boot under TCG; ``kernel="vmlinuz"`` boots the bzImage)
(a sparse raw file, virtio serial ``aurae-data``, blank at first) and one NIC on a tap of the
test's own: a /30 from the VM pool helpers (``auraed.vms.network``: a block no host address or
route touches, a tap ``atap<N>`` whose alias names its owner), the machine's address given on the
kernel command line as ``ip=`` -- no ``auraed.role``. QEMU runs without ``-no-reboot``, so a
reboot the machine asks for restarts it in the same QEMU process (same disks), as a server's
reset does. The console (serial) is collected by a thread; ``close`` kills QEMU and removes the
tap and every file.

``DiskMachine`` boots host-image's ``disk.img`` instead, as a PC or server boots it after ``dd``:
a grown copy as a q35 machine's SATA disk, an Intel e1000e NIC, UEFI (OVMF: Secure Boot off, on
with the image's own keys, or on with Microsoft's, as a stock machine ships) or legacy BIOS
(SeaBIOS) firmware, the address by DHCP (busybox udhcpd on the tap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Generic, TypeVar

from auraed.client import AuraeClient, ClientConfig
from auraed.init.hostpki import BEGIN, END
from auraed.vms import network
from auraed.vms.qemu import MICROVM, host_tsc_khz

READY_MARKER = "(shown on the console at first boot)"
"""The end of the status screen PID 1 prints once the daemon serves (its last line): waiting for
its first line instead raced the rest of the screen (the CA fingerprint) to the console."""
TEST_RANGE = ipaddress.IPv4Network("10.213.64.0/18")  # the host-image tests' share of the VM pool
CONFIG_SERIAL = "aurae-config"  # a config disk's virtio serial (auraed.config_disk=serial=...)


def build_host_image() -> Path:
    prebuilt = os.environ.get("AURAED_TEST_HOST_IMAGE")
    if prebuilt:
        return Path(prebuilt)
    build = Path(__file__).resolve().parents[2] / "host-image" / "build"
    result = subprocess.run([str(build)], capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, f"host-image/build failed:\n{result.stderr[-4000:]}"
    return Path(result.stdout.strip().splitlines()[-1])


class HostMachine:
    def __init__(
        self,
        image: Path,
        *,
        memory_mib: int = 1024,
        data_mib: int = 512,
        extra_append: str = "",
        initramfs: str = "initramfs.img",
        static_ip: bool = True,
        kernel: str = "vmlinux",
        config_disk: Path | None = None,
    ) -> None:
        self.image = image
        self.root = Path(tempfile.mkdtemp(prefix="aurae-hostvm-", dir="/tmp"))
        self.owner = f"auraed-vm {self.root}/machine"
        self.data_disk = self.root / "data.img"
        with self.data_disk.open("wb") as handle:
            handle.truncate(data_mib * 1024 * 1024)
        pool = _free_block_pool()
        self.net = network.pick(pool, [], [])
        for _ in range(16):
            try:
                network.create_tap(self.net, self.owner)
                break
            except network.TapNameTaken as taken:  # a daemon of another test worker made it meanwhile
                self.net = dataclasses.replace(self.net, tap=network.free_tap_name({taken.tap}))
        else:
            raise AssertionError(f"no free tap name for {self.root}")
        self.address = self.net.guest_ip
        mask = ipaddress.IPv4Network(f"0.0.0.0/{self.net.prefixlen}").netmask
        ip = f"ip={self.net.guest_ip}::{self.net.host_ip}:{mask}:aurae-host:eth0:off" if static_ip else ""
        if config_disk is not None:  # mounted on /etc/aurae in place of the image's configuration
            extra_append += f" auraed.config_disk=serial={CONFIG_SERIAL}"
        append = (
            f"console=ttyS0 tsc_early_khz={host_tsc_khz()} auraed.root=serial=aurae-root {ip} {extra_append}"
        )
        self.args = [
            "qemu-system-x86_64",
            "-M", MICROVM, "-accel", "tcg", "-cpu", "max", "-m", str(memory_mib), "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none",
            "-serial", "stdio",
            "-kernel", str(image / kernel), "-initrd", str(image / initramfs),
            "-append", append.strip(),
            "-drive", f"id=root,file={image / 'rootfs.img'},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root,serial=aurae-root",
            "-drive", f"id=data,file={self.data_disk},format=raw,if=none",
            "-device", "virtio-blk-device,drive=data,serial=aurae-data",
            "-netdev", f"tap,id=net0,ifname={self.net.tap},script=no,downscript=no",
            "-device", f"virtio-net-device,netdev=net0,mac={self.net.mac}",
            "-object", "rng-random,id=rng0,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng0",
        ]  # fmt: skip
        if config_disk is not None:
            self.args += [
                "-drive", f"id=config,file={config_disk},format=raw,if=none,readonly=on",
                "-device", f"virtio-blk-device,drive=config,serial={CONFIG_SERIAL}",
            ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self._output: list[str] = []
        self._arrived: list[tuple[int, float]] = []  # (console offset after a line, when it came)
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            text = raw.decode(errors="replace")
            with self._lock:
                self._output.append(text)
                end = (self._arrived[-1][0] if self._arrived else 0) + len(text)
                self._arrived.append((end, time.monotonic()))

    @property
    def console(self) -> str:
        with self._lock:
            return "".join(self._output)

    def seen_at(self, text: str, since: int = 0) -> float:
        """Seconds since ``start`` at which the console line holding ``text`` (after ``since``) came."""
        index = self.console.index(text, since)
        with self._lock:
            return next(when for end, when in self._arrived if end > index) - self.started

    def mark(self) -> int:
        """Where the console is now: ``wait_for(..., since=mark)`` looks only at what follows."""
        return len(self.console)

    def wait_for(self, text: str, timeout: float, since: int = 0) -> float:
        """Seconds since ``start`` until ``text`` appears on the console after offset ``since``."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.console[since:]:
                return time.monotonic() - self.started
            if self.process.poll() is not None:
                code = self.process.returncode
                raise AssertionError(f"QEMU exited ({code}) before {text!r}:\n{self.tail()}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.tail()}")

    def type_line(self, text: str) -> None:
        """``text`` and Enter typed on the machine's serial console (QEMU's stdin)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(text.encode() + b"\r")
        self.process.stdin.flush()

    def tail(self, chars: int = 6000) -> str:
        return self.console[-chars:]

    def wait_exit(self, timeout: float) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"QEMU still running {timeout}s later:\n{self.tail()}") from None

    def client_config(self, directory: Path, since: int = 0) -> ClientConfig:
        """The client configuration the first boot showed on the console, written to ``directory``
        by running it as the operator would (sh, in an empty directory)."""
        text = self.console[since:]
        start = text.index(BEGIN)
        script = text[start : text.index(END, start)].replace("\r\n", "\n")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "client.sh").write_text(script.split("\n", 1)[1])
        subprocess.run(["sh", "client.sh"], cwd=directory, check=True)
        from auraed.client.client import load_client_config

        return load_client_config(directory / "config")

    def close(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            if self._reader is not None:
                self._reader.join(5)
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        with contextlib.suppress(Exception):
            network.delete_tap(self.net.tap, self.owner)
        shutil.rmtree(self.root, ignore_errors=True)


OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_SECBOOT_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")  # Secure Boot: needs SMM
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")  # blank: no keys, Secure Boot off
# Microsoft's KEK and db (Windows Production PCA 2011, UEFI CA 2011) enrolled, Secure Boot on: a
# stock PC's or server's variables, as Debian's ovmf ships them.
OVMF_MS_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.ms.fd")
FIRMWARES = ("uefi", "uefi-secure-boot", "uefi-microsoft", "bios")
UKI_BOOT_ENTRY = "\\EFI\\aurae\\aurae.efi"  # the owner-signed UKI's boot entry (mkdisk.UKI_PATH)
GROW = 512 * 1024 * 1024  # the copy is a disk bigger than the image, as a real one is


class DiskMachine(HostMachine):
    """HostMachine's tap, console and clean-up; booted from disk.img by OVMF (``firmware="uefi"``:
    the removable-media path, shim and GRUB), OVMF with Secure Boot on and the image's own keys
    enrolled (``"uefi-secure-boot"``: PK, KEK and db from its secureboot/, by virt-firmware's
    virt-fw-vars, on a q35 with SMM, and the boot entry an owner adds for the signed UKI), OVMF
    with Secure Boot on and only Microsoft's keys (``"uefi-microsoft"``: the removable-media path,
    Debian's Microsoft-signed shim) or SeaBIOS (``"bios"``), addressed by DHCP. ``boot`` starts a
    new QEMU on the same disk."""

    def __init__(self, image: Path, firmware: str = "uefi") -> None:
        super().__init__(image, data_mib=1, static_ip=False)
        self.data_disk.unlink()  # HostMachine's separate data disk: the partition is the data disk here
        self.disk = self.root / "disk.img"
        subprocess.run(["cp", "--sparse=always", str(image / "disk.img"), str(self.disk)], check=True)
        with self.disk.open("r+b") as handle:
            handle.truncate(self.disk.stat().st_size + GROW)
        shutil.copy(OVMF_VARS, self.root / "vars.fd")
        self.udhcpd: subprocess.Popen[bytes] | None = None
        self.firmware = firmware
        self.args = self.qemu_args(firmware)

    def qemu_args(self, firmware: str) -> list[str]:
        assert firmware in FIRMWARES
        machine, pflash = "q35", []
        if firmware == "uefi":
            pflash = [
                "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                "-drive", f"if=pflash,format=raw,unit=1,file={self.root / 'vars.fd'}",
            ]  # fmt: skip
        elif firmware in ("uefi-secure-boot", "uefi-microsoft"):
            machine = "q35,smm=on"  # the secboot build keeps its variables in SMM: nothing else writes db
            variables = self.enrolled_vars() if firmware == "uefi-secure-boot" else self.microsoft_vars()
            pflash = [
                "-global", "driver=cfi.pflash01,property=secure,value=on",
                "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_SECBOOT_CODE}",
                "-drive", f"if=pflash,format=raw,unit=1,file={variables}",
            ]  # fmt: skip
        return [
            "qemu-system-x86_64",
            "-M", machine, "-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio",
            *pflash,  # none: SeaBIOS, QEMU's own
            "-drive", f"id=disk,file={self.disk},format=raw,if=none",
            "-device", "ide-hd,drive=disk,bus=ide.0",  # SATA port 0 of q35's ICH9 AHCI
            "-netdev", f"tap,id=net0,ifname={self.net.tap},script=no,downscript=no",
            "-device", f"e1000e,netdev=net0,mac={self.net.mac}",  # Intel's 82574L: a PC's NIC, not virtio
            "-object", "rng-random,id=rng0,filename=/dev/urandom",
            "-device", "virtio-rng-pci,rng=rng0",
        ]  # fmt: skip

    def enrolled_vars(self) -> Path:
        """A copy of OVMF's blank variables with the image's PK, KEK and db enrolled, Secure Boot on,
        and a boot entry for the UKI (a short-form file path: the firmware finds it on the ESP), as
        its owner adds with efibootmgr or the firmware's screens."""
        path = self.root / "vars-secure-boot.fd"
        if not path.exists():
            keys = self.image / "secureboot"
            owner = "a5ea0e7b-6b1e-4d2f-9c2a-2d7c1f0a0e11"  # any GUID: who "owns" each entry
            tool = Path(sys.executable).parent / "virt-fw-vars"
            subprocess.run(
                [
                    str(tool), "--input", str(OVMF_VARS), "--output", str(path),
                    "--set-pk", owner, str(keys / "PK.crt"), "--add-kek", owner, str(keys / "KEK.crt"),
                    "--add-db", owner, str(keys / "db.crt"), "--no-microsoft", "--sb",
                    "--append-boot-filepath", UKI_BOOT_ENTRY,
                ],
                check=True, capture_output=True,
            )  # fmt: skip
        return path

    def microsoft_vars(self) -> Path:
        """A copy of OVMF's variables with Microsoft's keys enrolled (Secure Boot on), no boot entry."""
        path = self.root / "vars-microsoft.fd"
        if not path.exists():
            shutil.copy(OVMF_MS_VARS, path)
        return path

    def boot(self, firmware: str) -> None:
        """A new QEMU on the same disk (and tap, DHCP server, console) after the last one ended."""
        assert self.process is not None and self.process.poll() is not None
        if self._reader is not None:
            self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.firmware = firmware
        self.args = self.qemu_args(firmware)
        HostMachine.start(self)

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


def _free_block_pool() -> ipaddress.IPv4Network:
    """A /28 of TEST_RANGE nothing on the host overlaps (the VM tests' helper, with our range)."""
    from tests.integration.test_vms import free_test_pool

    return free_test_pool(within=TEST_RANGE)


M = TypeVar("M", bound=HostMachine)


class Booted(Generic[M]):
    """A booted host machine, the client config its first boot printed, and how long that took."""

    def __init__(self, machine: M, config: ClientConfig, first_ready: float) -> None:
        self.machine = machine
        self.config = config
        self.first_ready = first_ready

    def client(self) -> AuraeClient:
        return AuraeClient.connect(self.config)
