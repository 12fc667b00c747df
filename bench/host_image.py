"""A machine booted from the host image: boot to SERVING (health over mTLS on TCP, from this host),
from kernel + initramfs and from disk.img by UEFI, against a bare boot of the same kernel; one run.

    .venv/bin/python bench/host_image.py [--rounds 3] [--memory-mib 1024] [--host-image DIR] [--json-only]

Each round, in this order:

* ``first``: a machine with a blank data disk (tests/support/hostvm.py's HostMachine: kernel
  (``vmlinuz``, the bzImage, as PXE boots it and the disk's boot loaders load it; the tests boot
  ``vmlinux`` instead) + initramfs + the root image, a tap of our own with ``ip=``), from
  starting QEMU until a client on this host gets health SERVING over mTLS at the machine's
  address. That includes formatting the data disk and making the PKI; the client's certificate is
  taken off the console (shown once at first boot), then health is polled every 50 ms with short
  reconnect backoff.
* ``reboot``: SystemService Shutdown with reboot on that machine, from the request until SERVING
  again (the same QEMU process: the daemon stops, PID 1 syncs, unmounts and resets; the kernel,
  the initramfs and auraed start again, reusing the disk and the PKI).
* ``bare``: the same kernel, QEMU command line (machine, accelerator, memory, disks, NIC) with the
  bare initramfs, whose /init prints AURAE-BARE-BOOT-OK and powers off: until that marker.
* ``disk``: disk.img as a PC boots it (tests/support/hostvm.py's DiskMachine, test_host_disk's
  machine: a grown copy as the SATA disk of a q35 machine, 1 GiB, OVMF, the address by DHCP): from
  starting QEMU until health SERVING over mTLS, as ``first`` (a first boot: the data partition
  grown and formatted, a new PKI). The firmware's part is until the kernel's first console line.
* ``bare_q35``: the same kernel and bare initramfs on the disk's q35 machine (same devices, SeaBIOS
  loading ``-kernel``/``-initrd`` itself: no disk read, no UEFI): what a PC's machine costs the
  kernel, without the firmware.

Where the first boot's time goes is read off the console (the kernel's printk clock at
``Run /init``, PID 1's boot line, the daemon's start and serving lines). Every machine is killed,
its tap and files removed, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from common import machine_info, print_json, print_table, ratio, summarize, temp_dir
from container_start import tests_support

from auraed.api.aurae.system import v0 as system_pb
from auraed.client import AuraeClient, ClientConfig

BARE_MARKER = "AURAE-BARE-BOOT-OK"
TIMEOUT = 300.0


async def wait_serving(config: ClientConfig, deadline: float) -> float:
    """Poll health over mTLS until SERVING; the monotonic time it came."""
    import grpc
    from grpc_health.v1 import health_pb2

    from auraed.client.client import channel_for

    while time.monotonic() < deadline:
        channel = channel_for(config)
        try:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            while time.monotonic() < deadline:
                try:
                    reply = await check(health_pb2.HealthCheckRequest(), timeout=2)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
                    continue
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic()
                await asyncio.sleep(0.05)
        finally:
            await channel.close()
    raise TimeoutError("no health SERVING in time")


def phases(console: str) -> dict[str, float]:
    """Guest-side moments of a boot, in seconds of the guest's clock where it has one."""
    found: dict[str, float] = {}
    for line in console.splitlines():
        if "Run /init as init process" in line and line.startswith("["):
            found["kernel_to_init_s"] = float(line[1 : line.index("]")])
        elif "starting /sbin/aurae-init at" in line:
            found["initramfs_done_s"] = float(line.rsplit(" at ", 1)[1].rstrip("s"))
        elif "health      SERVING" in line and "after boot" in line:
            found["serving_uptime_s"] = float(line.split(", ")[1].split(" s after")[0])
    return found


async def boot_to_serving(machine: Any, client_dir: Path) -> tuple[ClientConfig, float]:
    """Start ``machine`` (a HostMachine or DiskMachine); its client config off the console and the
    seconds from QEMU's start until health answered SERVING over mTLS (then its status screen)."""
    from tests.support.hostvm import READY_MARKER

    machine.start()
    deadline = time.monotonic() + TIMEOUT
    machine.wait_for("----- END AURAE CLIENT CONFIG -----", TIMEOUT)
    config = machine.client_config(client_dir)
    serving = await wait_serving(config, deadline) - machine.started
    machine.wait_for(READY_MARKER, 30)
    return config, serving


def bare_boot(machine: Any) -> float:
    """Seconds until the bare initramfs's marker, then its power-off; the machine closed."""
    try:
        machine.start()
        seconds: float = machine.wait_for(BARE_MARKER, TIMEOUT)
        machine.wait_exit(60)
        return seconds
    finally:
        machine.close()


async def disk_boot(image: Path, work: Path, index: int) -> dict[str, Any]:
    """disk.img by UEFI until SERVING; then the bare initramfs on the same q35 machine."""
    from tests.support.hostvm import DiskMachine

    result: dict[str, Any] = {}
    machine = DiskMachine(image)
    try:
        _, result["disk_s"] = await boot_to_serving(machine, work / f"disk-client-{index}")
        result["disk_firmware_s"] = machine.seen_at("Linux version")
        result["disk_phases"] = phases(machine.console)
    finally:
        machine.close()
    bare = DiskMachine(image)
    bare.args = [
        *bare.qemu_args("bios"),
        "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "bare-initramfs.img"),
        "-append", "console=ttyS0",
    ]  # fmt: skip
    result["bare_q35_s"] = bare_boot(bare)
    return result


async def one_round(image: Path, memory_mib: int, work: Path, index: int) -> dict[str, Any]:
    from tests.support.hostvm import READY_MARKER, HostMachine

    result: dict[str, Any] = {}
    machine = HostMachine(image, memory_mib=memory_mib, kernel="vmlinuz")
    try:
        config, result["first_s"] = await boot_to_serving(machine, work / f"client-{index}")
        result["first_screen_s"] = machine.seen_at(READY_MARKER)
        result["first_phases"] = phases(machine.console)
        mark = machine.mark()
        asked = time.monotonic()
        async with AuraeClient.connect(config) as client:
            request = system_pb.SystemServiceShutdownRequest(reason="bench reboot", reboot=True)
            await client.call("aurae.system.v0.SystemService", "Shutdown", request)
        machine.wait_for("rebooting", 60, since=mark)
        result["reboot_s"] = await wait_serving(config, time.monotonic() + TIMEOUT) - asked
        machine.wait_for(READY_MARKER, 30, since=mark)
        result["reboot_screen_s"] = machine.seen_at(READY_MARKER, mark) - (asked - machine.started)
        result["reboot_phases"] = phases(machine.console[mark:])
    finally:
        machine.close()
    bare = HostMachine(image, memory_mib=memory_mib, initramfs="bare-initramfs.img", kernel="vmlinuz")
    result["bare_s"] = bare_boot(bare)
    result.update(await disk_boot(image, work, index))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-mib", type=int, default=1024)
    parser.add_argument("--host-image", type=Path, default=None)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    tests_support()
    from tests.support.hostvm import build_host_image

    image = args.host_image or build_host_image()
    info = machine_info()
    rounds = []
    with temp_dir("aurae-bench-host-") as work:
        for index in range(args.rounds):
            rounds.append(asyncio.run(one_round(image, args.memory_mib, work, index)))
            if not args.json_only:
                print(f"round {index + 1}: {rounds[-1]}", file=sys.stderr, flush=True)
    names = ("first", "reboot", "bare", "disk", "disk_firmware", "bare_q35")
    series = {name: summarize([r[f"{name}_s"] for r in rounds]) for name in names}
    result = {
        "benchmark": "host_image",
        "machine": info,
        "image": str(image),
        "memory_mib": args.memory_mib,
        "series": series,
        "first_vs_bare": ratio(series["first"]["p50_ms"], series["bare"]["p50_ms"]),
        "reboot_vs_bare": ratio(series["reboot"]["p50_ms"], series["bare"]["p50_ms"]),
        "disk_vs_bare": ratio(series["disk"]["p50_ms"], series["bare"]["p50_ms"]),
        "disk_vs_bare_q35": ratio(series["disk"]["p50_ms"], series["bare_q35"]["p50_ms"]),
        "disk_vs_first": ratio(series["disk"]["p50_ms"], series["first"]["p50_ms"]),
        "rounds": rounds,
    }
    if not args.json_only:
        rows = [
            [name, s["n"], s["p50_ms"] / 1000, s["min_ms"] / 1000, s["max_ms"] / 1000]
            for name, s in series.items()
        ]
        print_table(
            "host image boot to SERVING vs a bare boot (s)", ["series", "n", "p50", "min", "max"], rows
        )
        print(f"first boot {result['first_vs_bare']}x the bare boot; reboot {result['reboot_vs_bare']}x")
        print(
            f"disk.img (UEFI) {result['disk_vs_bare']}x the bare boot, {result['disk_vs_bare_q35']}x"
            f" the bare boot on q35, {result['disk_vs_first']}x the first boot from kernel + initramfs"
        )
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
