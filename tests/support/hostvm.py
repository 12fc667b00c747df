"""A machine booted from the host image under QEMU (TCG), the way an operator boots a server.

``HostMachine`` boots ``host-image/build``'s kernel + initramfs with its root image and a data disk
(a sparse raw file, virtio serial ``aurae-data``, blank at first) and one NIC on a tap of the
test's own: a /30 from the VM pool helpers (``auraed.vms.network``: a block no host address or
route touches, a tap ``atap<N>`` whose alias names its owner), the machine's address given on the
kernel command line as ``ip=`` -- no ``auraed.role``. QEMU runs without ``-no-reboot``, so a
reboot the machine asks for restarts it in the same QEMU process (same disks), as a server's
reset does. The console (serial) is collected by a thread; ``close`` kills QEMU and removes the
tap and every file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import shutil
import subprocess
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
        append = (
            f"console=ttyS0 tsc_early_khz={host_tsc_khz()} auraed.root=serial=aurae-root {ip} {extra_append}"
        )
        self.args = [
            "qemu-system-x86_64",
            "-M", MICROVM, "-accel", "tcg", "-cpu", "max", "-m", str(memory_mib), "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none",
            "-serial", "stdio",
            "-kernel", str(image / "vmlinuz"), "-initrd", str(image / initramfs),
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
        self.process: subprocess.Popen[bytes] | None = None
        self._output: list[str] = []
        self._arrived: list[tuple[int, float]] = []  # (console offset after a line, when it came)
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
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
            if self.process.stdout is not None:
                self.process.stdout.close()
        with contextlib.suppress(Exception):
            network.delete_tap(self.net.tap, self.owner)
        shutil.rmtree(self.root, ignore_errors=True)


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
