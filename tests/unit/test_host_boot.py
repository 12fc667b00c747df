"""The host image's PID 1 pieces without a machine: ip=, the data disk on files, the notify
protocol, the CA fingerprint, the client bundle, and the daemon supervisor with a stand-in daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from auraed.client.client import load_client_config
from auraed.init import datadisk, hostpki, ipconfig
from auraed.init.host import (
    ConsoleShell,
    DaemonSupervisor,
    HostBoot,
    HostProfile,
    ca_fingerprint,
    parse_notify,
    status_screen,
)
from auraed.pki import ensure_dev_pki
from auraed.pki.certs import create_ca, write_pem_files


def test_ip_static_dhcp_and_off() -> None:
    got = ipconfig.parse("10.1.2.3::10.1.2.1:255.255.255.252:node1:eth0:off:10.1.2.1")
    assert got == ipconfig.IpConfig("static", "10.1.2.3", 30, "10.1.2.1", "node1", "eth0", ("10.1.2.1",))
    assert ipconfig.parse("10.1.2.3:::24").prefix == 24
    assert ipconfig.parse("10.1.2.3::::h").prefix == 24  # initramfs-tools' default
    assert ipconfig.parse("dhcp").mode == "dhcp"
    assert ipconfig.parse(":::::eth1:dhcp") == ipconfig.IpConfig("dhcp", device="eth1")
    assert ipconfig.parse("off").mode == "off"
    assert ipconfig.from_cmdline("console=ttyS0 ip=dhcp ip=off -- ip=10.0.0.1") == ipconfig.IpConfig("off")
    assert ipconfig.from_cmdline("console=ttyS0") is None
    for bad in ("10.1.2.300::::", "10.1.2.3:::255.0.255.0", "10.1.2.3::::h:eth0:dhcp", "10.1.2.3:::33"):
        with pytest.raises(ValueError, match="ip="):
            ipconfig.parse(bad)


def fake_disk(root: Path, name: str, serial: str, size: int = 32 << 20) -> Path:
    """/sys/block/<name> with a serial and a device link, and /dev/<name> as a sparse file."""
    (root / "sys/block" / name / "device").mkdir(parents=True)
    (root / "sys/block" / name / "serial").write_text(serial + "\n")
    (root / "dev").mkdir(exist_ok=True)
    device = root / "dev" / name
    with device.open("wb") as handle:
        handle.truncate(size)
    return device


def test_the_data_disk_is_found_by_label_or_serial_and_formatted_only_when_blank(tmp_path: Path) -> None:
    blank = fake_disk(tmp_path, "vdb", "aurae-data")
    other = fake_disk(tmp_path, "vdc", "something")
    sys_dir, dev_dir = str(tmp_path / "sys"), str(tmp_path / "dev")
    assert datadisk.find("AURAE-DATA", "aurae-data", sys_dir, dev_dir) == (str(blank), "serial aurae-data")
    assert datadisk.is_blank(str(blank))
    datadisk.format_ext4(str(blank), "AURAE-DATA")
    assert datadisk.ext4_label(str(blank)) == "AURAE-DATA"
    # Labelled, it is found by its label first, wherever it is.
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "AURAE-DATA", str(other)], check=True)
    blank.write_bytes(b"\0" * 4096)
    assert datadisk.find("AURAE-DATA", "aurae-data", sys_dir, dev_dir) == (str(other), "label AURAE-DATA")
    # A disk with the serial that holds anything is never formatted.
    other.write_bytes(b"\0" * 4096)
    blank.write_bytes(b"\0" * 512 + b"EFI PART")
    with pytest.raises(datadisk.DataDiskError, match="not blank"):
        datadisk.prepare(
            "AURAE-DATA", "aurae-data", str(tmp_path / "mnt"), 0.1, sys_dir=sys_dir, dev_dir=dev_dir
        )
    assert datadisk.find("AURAE-DATA", "nothing", sys_dir, dev_dir) is None


def test_notify_messages_and_the_ca_fingerprint(tmp_path: Path) -> None:
    assert parse_notify(b"READY=1\nSTATUS=serving\njunk") == {"READY": "1", "STATUS": "serving"}
    pki = ensure_dev_pki(tmp_path, client_names=())
    pem = pki.ca_crt.read_bytes()
    expected = x509.load_pem_x509_certificate(pem).fingerprint(hashes.SHA256())
    assert ca_fingerprint(pem) == ":".join(f"{b:02X}" for b in expected)


def profile(tmp_path: Path) -> HostProfile:
    return HostProfile(
        "AURAE-DATA", "aurae-data", str(tmp_path), 8443, str(tmp_path / "tls"), str(tmp_path / "client"), ""
    )


def test_the_profile_names_the_modules_to_load_and_a_missing_one_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "usr/lib/aurae").mkdir(parents=True)
    data = {
        "data_disk": {"label": "AURAE-DATA", "serial": "aurae-data", "mount": "/var/lib/aurae"},
        "api_port": 8443, "tls_dir": "t", "client_dir": "c", "dhcp_script": "s",
    }  # fmt: skip
    (tmp_path / "usr/lib/aurae/host.json").write_text(json.dumps(data))
    loaded = HostProfile.load(str(tmp_path))
    assert loaded is not None and loaded.modules == ()  # an older image's profile
    modules = ["kernel/drivers/net/tun.ko", "kernel/arch/x86/kvm/kvm.ko"]
    (tmp_path / "usr/lib/aurae/host.json").write_text(json.dumps({**data, "modules": modules}))
    loaded = HostProfile.load(str(tmp_path))
    assert loaded is not None and loaded.modules == tuple(modules)
    # Not in this machine's module tree: nothing is loaded, nothing raised.
    HostBoot(loaded._replace(modules=("kernel/no/such-module.ko",)), "").load_modules()


def test_the_client_config_is_shown_once_and_runs_as_a_script(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    host = profile(tmp_path / "state")
    fingerprint, shown = hostpki.ensure(host)
    console = capfd.readouterr().err
    assert shown and f"CA SHA-256 fingerprint: {fingerprint}" in console
    script = console[console.index(hostpki.BEGIN) : console.index(hostpki.END)].split("\n", 1)[1]
    operator = tmp_path / "operator"
    operator.mkdir()
    (operator / "client.sh").write_text(script)
    subprocess.run(["sh", "client.sh"], cwd=operator, check=True)
    config = load_client_config(operator / "config")
    assert config.client_key.read_bytes() == (Path(host.client_dir) / "aurae-admin.key").read_bytes()
    assert config.address.endswith(":8443") and oct(config.client_key.stat().st_mode & 0o777) == "0o600"
    # Later boots reuse the CA and show nothing.
    assert hostpki.ensure(host) == (fingerprint, False)
    assert hostpki.BEGIN not in capfd.readouterr().err


def test_an_operators_ca_put_on_the_data_disk_first_is_the_hosts(tmp_path: Path) -> None:
    host = profile(tmp_path / "state")
    tls = Path(host.tls_dir)
    tls.mkdir(parents=True)
    operator = create_ca()
    write_pem_files(tls, "ca", operator.cert, operator.key)
    ca_pem = (tls / "ca.crt").read_bytes()
    fingerprint, shown = hostpki.ensure(host)
    assert shown and fingerprint == ca_fingerprint(ca_pem)
    assert (tls / "ca.crt").read_bytes() == ca_pem  # kept, not replaced
    server = x509.load_pem_x509_certificate((tls / "server.crt").read_bytes())
    assert server.issuer == operator.cert.subject  # the host's certificate is from the operator's CA
    assert (Path(host.client_dir) / "ca.crt").read_bytes() == ca_pem


STAND_IN = """
import os, signal, sys, time
from auraed.system.sdnotify import notify
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)  # the first run dies
notify("READY=1")
notify("AURAE_ACTION=reboot\\nAURAE_REASON=asked")
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(60)
"""


async def test_the_supervisor_restarts_a_dead_daemon_and_relays_its_requests(tmp_path: Path) -> None:
    actions: list[tuple[str, str]] = []
    boot = HostBoot(profile(tmp_path), "")
    supervisor = DaemonSupervisor(
        [], boot, lambda action, reason: actions.append((action, reason)), stop_grace=1.0,
        environ={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        socket_path=str(tmp_path / "init.sock"),
    )  # fmt: skip
    supervisor.backoff = (0.1,)
    supervisor.command = lambda: [sys.executable, "-c", STAND_IN, str(tmp_path / "ran")]  # type: ignore[method-assign]
    task = asyncio.create_task(supervisor.run())
    for _ in range(600):
        if actions:
            break
        await asyncio.sleep(0.05)
    assert actions == [("reboot", "asked")]
    assert supervisor.restarts == 1 and supervisor.ready_at is not None
    supervisor.request_stop()
    assert await asyncio.wait_for(task, 30) == 0
    assert not (tmp_path / "init.sock").exists()


def test_the_profiles_state_dirs_are_made_under_the_state_dir_only(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    wanted = ("cni/net.d", "../outside", "/etc/abs", "a/../../escape")
    HostBoot(profile(state)._replace(state_dirs=wanted), "").make_state_dirs()
    assert (state / "cni/net.d").is_dir() and (state / "cni/net.d").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # nothing made outside it
    assert sorted(p.name for p in state.iterdir()) == ["cni"]
    HostBoot(profile(state)._replace(state_dirs=("cni/net.d",)), "").make_state_dirs()  # again: no error


async def test_the_console_shell_runs_once_per_enter_and_stops_at_the_consoles_end(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    closed: list[int] = []
    record = tmp_path / "sessions"
    shell = ConsoleShell(
        lambda: closed.append(len(closed)),
        fd=read_end,
        argv=("sh", "-c", f"echo one >> {record}"),
        environ={},
    )
    shell.start(asyncio.get_running_loop())

    async def sessions(count: int) -> None:
        for _ in range(200):
            if len(closed) >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{len(closed)} sessions, not {count}")

    os.write(write_end, b"no newline yet")
    await asyncio.sleep(0.2)
    assert closed == []  # a shell only at Enter
    os.write(write_end, b"\n")
    await sessions(1)
    os.write(write_end, b"\r\n")
    await sessions(2)
    assert record.read_text() == "one\none\n" and shell.sessions == 2
    os.close(write_end)  # the console's end: nothing more is read, no shell started
    await asyncio.sleep(0.2)
    assert closed == [0, 1] and not shell._listening
    shell.stop()
    os.close(read_end)


def test_no_console_shell_unless_the_config_says_so(tmp_path: Path) -> None:
    boot = HostBoot(profile(tmp_path), "")
    assert DaemonSupervisor([], boot, lambda a, r: None, stop_grace=1.0).shell is None
    assert DaemonSupervisor([], boot, lambda a, r: None, stop_grace=1.0, console_shell=True).shell is not None
    screen = status_screen(boot, 42, 0, shell=True)
    assert "press Enter for a root shell" in screen and screen.splitlines()[-2].endswith(
        "(shown on the console at first boot)"
    )
    assert "root shell" not in status_screen(boot, 42, 0)
