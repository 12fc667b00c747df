"""auraed as PID 1, for real on this host -- but always PID 1 of a NEW pid namespace, never the host's.

Every PID-1 run here is ``unshare --pid --fork --mount-proc --mount --uts --ipc``: its mounts go
under a temporary root (AURAED_PID1_ROOT) in a private mount namespace, its hostname into its own
uts namespace; the network is configured inside a network namespace made for the test, the config
disk is a squashfs on a loop device. Power-off can only end such a PID 1 by exiting (the guard
reserves reboot() to PID 1 of the initial pid namespace); nothing here calls reboot() in this
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.observe import v0 as observe
from auraed.bootargs import BootArgs
from auraed.errors import AuraeError
from auraed.init import pid1, powerbutton
from auraed.init.pid1 import Pid1, Pid1Layout, enable_controllers
from auraed.init.powerbutton import EV_KEY, KEY_POWER, InputEventParser, PowerButtonWatcher, encode_event
from auraed.pki import PkiPaths
from tests.conftest import DaemonProcess, remove_daemon_leftovers, wait_until
from tests.integration.test_cells import OBSERVE, allocate, start, wait_exited
from tests.integration.test_guest_image import config_disk

REPO = Path(__file__).resolve().parents[2]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--ipc", "--kill-child"]
ORPHANS = 50

# Runs as PID 1 of a new pid namespace: Pid1.boot() (mounts under AURAED_PID1_ROOT), then Pid1.run
# with a stand-in daemon whose run() stresses reaping against every way auraed waits for its own
# children, prints one JSON line, and serves until SIGTERM.
WORKLOAD = r"""
import asyncio, json, os, subprocess, sys, time
from pathlib import Path

from auraed.bootargs import BootArgs
from auraed.init import pid1
from auraed.init.pid1 import Pid1, Pid1Layout
from auraed.system import processes
from auraed.system.monitor_protocol import MonitorSpec
from auraed.system.supervisor import Supervisor

ORPHANS = int(sys.argv[1])
WORK = Path(sys.argv[2])


def zombies_of_pid1():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                data = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            fields = data[data.rfind(b")") + 2 :].split()
            if fields[0] == b"Z" and fields[1] == b"1":
                found.append(int(name))
    return found


def sleepers():
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += Path(f"/proc/{name}/comm").read_text().strip() == "sleep"
            except OSError:
                pass
    return count


# Every process of this pid namespace but PID 1, with its command: a child forked but not yet
# exec'd (a subshell's sleep) is neither a sleeper nor a zombie yet, and would end later.
def others():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                found.append([int(name), Path(f"/proc/{name}/comm").read_text().strip()])
            except OSError:
                pass
    return found


def mounts_under(root):
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4].startswith(root + "/"):
            tail = fields[fields.index("-") + 1 :]
            found.append([fields[4][len(root) :], tail[0], fields[5], tail[2]])
    return found


class Workload:
    def __init__(self, init):
        self.init = init
        self.stopped = None

    def request_stop(self):
        self.stopped.set()

    async def run(self):
        self.stopped = asyncio.Event()
        try:
            result = await self.work()
        except BaseException as exc:
            result = {"error": repr(exc)}
        print(json.dumps(result), flush=True)
        await self.stopped.wait()
        return 0

    async def work(self):
        init = self.init

        async def popen(code):  # Popen.wait in a worker thread, with an orphan dying meanwhile
            child = subprocess.Popen(["sh", "-c", f"(sleep 0.1 &) ; sleep 0.0{code % 10}; exit {code}"])
            return await asyncio.to_thread(child.wait)

        async def create_subprocess(code):  # asyncio's child watcher (waitpid(pid) in a thread)
            child = await asyncio.create_subprocess_exec("sh", "-c", f"(sleep 0.1 &) ; exit {code}")
            return await child.wait()

        async def run_in_thread(code):  # subprocess.run in a worker, like the capability probe
            done = await asyncio.to_thread(subprocess.run, ["sh", "-c", f"exit {code}"])
            return done.returncode

        async def waitpid(code):  # os.waitpid(pid) through auraed.system.processes.reap
            child = subprocess.Popen(["sh", "-c", f"sleep 0.05; exit {code}"])
            ticks = processes.start_ticks(child.pid)
            await processes.wait_for_exit(child.pid, ticks)
            status = processes.reap(child.pid)
            return None if status is None else os.waitstatus_to_exitcode(status)

        async def forked(code):  # os.fork: registered by hand with ChildRegistry.own
            pid = os.fork()
            if pid == 0:
                os._exit(code)
            init.registry.own(pid)
            try:
                while True:
                    waited, status = os.waitpid(pid, os.WNOHANG)
                    if waited:
                        return os.waitstatus_to_exitcode(status)
                    await asyncio.sleep(0.005)
            finally:
                init.registry.disown(pid)

        async def supervised(code, index):  # the Supervisor's monitor, as executables run
            run_dir = WORK / f"supervised-{index}"
            run_dir.mkdir(parents=True)
            spec = MonitorSpec(
                argv=["sh", "-c", f"(sleep 0.1 &) ; exit {code}"],
                log_path=str(run_dir / "out.log"),
                exit_path=str(run_dir / "exit.json"),
            )
            supervisor = Supervisor(run_dir)
            try:
                handle = await supervisor.launch(spec, run_dir)
                record = await supervisor.wait(handle, run_dir / "exit.json")
            finally:
                supervisor.close()
            return None if record is None else record.exit_code

        makers = await asyncio.create_subprocess_exec(
            "sh", "-c", f"i=0; while [ $i -lt {ORPHANS} ]; do (sleep 0.1 &) ; i=$((i+1)); done; exit 42"
        )
        cases = {
            "popen": [popen(c) for c in range(1, 31)],
            "asyncio": [create_subprocess(c) for c in range(1, 31)],
            "run": [run_in_thread(c) for c in range(1, 11)],
            "waitpid": [waitpid(c) for c in range(1, 11)],
            "fork": [forked(c) for c in range(1, 11)],
            "supervisor": [supervised(c, c) for c in range(1, 6)],
        }
        names = list(cases)
        groups = await asyncio.gather(*(asyncio.gather(*cases[n]) for n in names), makers.wait())
        codes = dict(zip(names, groups[:-1]))
        codes["orphan_maker"] = groups[-1]
        # Every orphan has ended and been reaped: within 20 s, for a machine under heavy load
        # (5 s was once not enough with a benchmark booting guests beside the suite).
        deadline = time.monotonic() + 20
        while others() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        root = init.layout.root.rstrip("/")
        before = mounts_under(root)
        init.mount_all()  # idempotent: nothing mounted twice
        saved, init.args = init.args, BootArgs(role="guest", poweroff=True)
        guard = {
            "initial_pid_ns": pid1.in_initial_pid_namespace(),
            "final_action_as_guest": init.final_action(),
        }
        init.args = saved
        try:
            pid1._reboot(pid1.RB_DISABLE_CAD)  # the guard refuses before any syscall
            guard["reboot"] = "called"
        except PermissionError:
            guard["reboot"] = "refused"
        pid1._power_off_machine(BootArgs(role="guest", poweroff=True))  # refused: we are still here
        return {
            "codes": codes,
            "zombies": zombies_of_pid1(),
            "sleepers": sleepers(),
            "others": others(),
            "reaped": init.reaper.reaped,
            "mounts": before,
            "mounts_again": mounts_under(root),
            "modes": {d: oct(os.stat(root + d).st_mode & 0o7777) for d in ("/tmp", "/run", "/dev/shm")},
            "guard": guard,
            "pid": os.getpid(),
        }


init = Pid1(Pid1Layout.from_env())
init.boot()
init.finish(init.run(Workload(init)))
"""


def _ns_init_pid(unshare_pid: int, timeout: float = 10.0) -> int:
    """The host pid of the namespace's PID 1 (unshare --fork's only child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.01)
    raise AssertionError("the namespace's PID 1 did not start")


def _zombie_children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                status = dict(
                    line.split(":\t", 1)
                    for line in (entry / "status").read_text().splitlines()
                    if ":\t" in line
                )
                if status.get("PPid") == str(parent) and status.get("State", "").startswith("Z"):
                    found.append(int(entry.name))
    return found


def _stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.kill()  # --kill-child takes the namespace down with it
        process.wait(timeout=30)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Under /tmp with a short name: unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="aurae-p1-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_pid1_reaps_orphans_keeps_owned_statuses_mounts_and_stops_on_sigterm(short_tmp: Path) -> None:
    script = short_tmp / "workload.py"
    script.write_text(WORKLOAD)
    root = short_tmp / "root"
    root.mkdir()
    console = short_tmp / "console.log"
    env = {**os.environ, "AURAED_PID1_ROOT": str(root)}
    with console.open("wb") as stderr:
        process = subprocess.Popen(
            [*UNSHARE, sys.executable, str(script), str(ORPHANS), str(short_tmp / "work")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        init_pid = _ns_init_pid(process.pid)
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, console.read_text()
        result = json.loads(line)
        assert "error" not in result, result
        codes = result["codes"]

        # Nobody's status was stolen: each owner got its child's own exit code (a stolen status
        # reads 0 through Popen and 255 through asyncio).
        assert codes["popen"] == list(range(1, 31))
        assert codes["asyncio"] == list(range(1, 31))
        assert codes["run"] == list(range(1, 11))
        assert codes["waitpid"] == list(range(1, 11))
        assert codes["fork"] == list(range(1, 11))
        assert codes["supervisor"] == list(range(1, 6))
        assert codes["orphan_maker"] == 42
        # Every orphan (ORPHANS from the maker, one per popen/asyncio/supervisor case) was reaped.
        assert result["zombies"] == [] and result["sleepers"] == 0, result["others"]
        assert result["others"] == []
        assert result["reaped"] >= ORPHANS + 30 + 30 + 5
        assert result["pid"] == 1

        mounts = {
            target: (fstype, options, super_options)
            for target, fstype, options, super_options in result["mounts"]
        }
        assert {t: m[0] for t, m in mounts.items()} == {
            "/proc": "proc",
            "/sys": "sysfs",
            "/dev": "devtmpfs",
            "/dev/pts": "devpts",
            "/dev/shm": "tmpfs",
            "/run": "tmpfs",
            "/tmp": "tmpfs",
            "/sys/fs/cgroup": "cgroup2",
        }
        assert "ptmxmode=666" in mounts["/dev/pts"][2]
        assert "nosuid" in mounts["/proc"][1] and "noexec" in mounts["/proc"][1]
        assert result["modes"] == {"/tmp": "0o1777", "/run": "0o755", "/dev/shm": "0o1777"}
        assert result["mounts_again"] == result["mounts"]

        # The power-off guard, inside the namespace: not the initial pid namespace, so even a
        # "guest" with auraed.poweroff=1 can only exit, and reboot() is refused before the syscall.
        assert result["guard"] == {
            "initial_pid_ns": False,
            "final_action_as_guest": "exit",
            "reboot": "refused",
        }
        assert _zombie_children(init_pid) == []

        os.kill(init_pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        log = console.read_text()
        assert "received SIGTERM: stopping auraed, then exiting" in log
        assert "auraed ended (status 0, received SIGTERM): exiting" in log
        assert "unmounted 8 file systems" in log
        assert "power off refused" in log
    finally:
        _stop(process)


@pytest.fixture
def pid1_daemon(pki: PkiPaths, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonProcess]:
    """``python -m auraed`` as PID 1 of a new pid namespace, watching a FIFO as its power button."""
    (short_tmp / "pid1-root").mkdir()
    button = short_tmp / "power-button"
    os.mkfifo(button)
    monkeypatch.setenv("AURAED_PID1_ROOT", str(short_tmp / "pid1-root"))
    monkeypatch.setenv("AURAED_PID1_POWER_BUTTON", str(button))
    (short_tmp / "d").mkdir()
    daemon = DaemonProcess(short_tmp / "d", pki, [])
    daemon.args = [*UNSHARE, *daemon.args]
    try:
        daemon.start()
        yield daemon
    finally:
        if daemon.process is not None:
            _stop(daemon.process)
        remove_daemon_leftovers(daemon)


async def test_auraed_as_pid1_serves_reaps_and_powers_off_on_the_power_button(
    pid1_daemon: DaemonProcess, short_tmp: Path
) -> None:
    daemon = pid1_daemon
    assert daemon.process is not None
    init_pid = _ns_init_pid(daemon.process.pid)
    # Hold the FIFO open for writing: PID 1 reads it like /dev/input/eventN.
    button = os.open(short_tmp / "power-button", os.O_RDWR | os.O_NONBLOCK)
    try:
        async with daemon.client() as client:
            await allocate(client, "orphans")
            await start(
                client,
                "orphans",
                "maker",
                f"i=0; while [ $i -lt {ORPHANS} ]; do (sleep 0.1 &) ; i=$((i+1)); done; exit 3",
            )
            exited = await wait_exited(client, "orphans", "maker")
            assert exited.exit_code == 3

            def reaped() -> int:
                return sum(
                    int(line.rsplit("reaped ", 1)[1].split()[0])
                    for line in daemon.log().splitlines()
                    if "auraed.pid1: reaped " in line
                )

            await wait_until(lambda: reaped() >= ORPHANS and not _zombie_children(init_pid), timeout=20)
            assert "watching the power button" in daemon.log()
            # PID 1's boot lines, logged before the Daemon's logging existed, reached Observe too.
            lines = [
                item.item.line
                async for item in client.stream(
                    OBSERVE, "GetAuraeDaemonLogStream", observe.ObserveServiceGetAuraeDaemonLogStreamRequest()
                )
            ]
            assert any(line.startswith("auraed.pid1: PID 1 boot done in") for line in lines), lines
            assert any(line.startswith("auraed.pid1: mounted ") for line in lines)
        # A press (EV_KEY KEY_POWER 1), then its release and a SYN, split mid-record.
        events = (
            encode_event(EV_KEY, KEY_POWER, 1) + encode_event(0, 0, 0) + encode_event(EV_KEY, KEY_POWER, 0)
        )
        os.write(button, events[:10])
        await asyncio.sleep(0.2)
        os.write(button, events[10:])
        assert await asyncio.to_thread(daemon.process.wait, 60) == 0
    finally:
        os.close(button)
    log = daemon.log()
    assert "PID 1 without a guest marker: bare-metal host" in log  # auraed itself was PID 1
    assert "PID 1 of a child pid namespace" not in log  # mounts went under the test root
    assert "power button: stopping auraed, then exiting" in log
    assert "auraed stopped" in log  # the Daemon's own graceful shutdown ran
    assert "auraed ended (status 0, power button): exiting" in log
    assert "Traceback" not in log


def test_power_button_events_from_a_pipe() -> None:
    parser = InputEventParser()
    stream = (
        encode_event(0, 0, 0)  # EV_SYN
        + encode_event(EV_KEY, KEY_POWER, 0)  # a release is not a press
        + encode_event(EV_KEY, 30, 1)  # another key
        + encode_event(EV_KEY, KEY_POWER, 1)
        + encode_event(EV_KEY, KEY_POWER, 2)  # autorepeat is not a new press
    )
    events = []
    for offset in range(0, len(stream), 7):  # records split at arbitrary points
        events += list(parser.feed(stream[offset : offset + 7]))
    assert events == [
        (0, 0, 0),
        (EV_KEY, KEY_POWER, 0),
        (EV_KEY, 30, 1),
        (EV_KEY, KEY_POWER, 1),
        (EV_KEY, KEY_POWER, 2),
    ]
    assert [powerbutton.is_power_press(*e) for e in events] == [False, False, False, True, False]
    assert powerbutton.INPUT_EVENT.size == 24  # struct input_event on x86_64

    async def watch() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        presses: list[str] = []
        read_end, write_end = os.pipe()
        path = f"/proc/self/fd/{read_end}"
        watcher = PowerButtonWatcher(loop, presses.append)
        watcher.watch(path)
        os.close(read_end)
        os.write(write_end, stream[:30])
        await asyncio.sleep(0.05)
        os.write(write_end, stream[30:])
        await wait_until(lambda: presses, timeout=5)
        os.close(write_end)  # end of stream: the watcher drops the device instead of spinning
        await wait_until(lambda: not watcher.devices, timeout=5)
        watcher.close()
        return presses, watcher.devices

    presses, left = asyncio.run(watch())
    assert presses == [presses[0]] and presses[0].startswith("/proc/self/fd/")
    assert left == []


def test_power_buttons_are_found_by_name(tmp_path: Path) -> None:
    for index, name in enumerate(["AT Translated Set 2 keyboard", "Power Button", "Power Button"]):
        device = tmp_path / "sys/class/input" / f"event{index}" / "device"
        device.mkdir(parents=True)
        (device / "name").write_text(name + "\n")
    (tmp_path / "sys/class/input/input7").mkdir()
    found = powerbutton.find_power_buttons(str(tmp_path / "sys"), "/dev")
    assert found == ["/dev/input/event1", "/dev/input/event2"]
    assert powerbutton.find_power_buttons(str(tmp_path / "nothing"), "/dev") == []


def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 address and route of the host (all tables)."""
    networks = []
    for entry in json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, check=True).stdout):
        for info in entry.get("addr_info", []):
            if info.get("family") == "inet":
                networks.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
    routes = subprocess.run(
        ["ip", "-4", "-j", "route", "show", "table", "all"], capture_output=True, check=True
    )
    for route in json.loads(routes.stdout):
        dst = route.get("dst", "")
        if dst and dst != "default":
            networks.append(ipaddress.ip_network(dst, strict=False))
    return [n for n in networks if isinstance(n, ipaddress.IPv4Network)]


def _free_test_subnet() -> ipaddress.IPv4Network:
    used = _host_networks()
    for third in range(256):
        for fourth in range(0, 256, 4):
            candidate = ipaddress.IPv4Network(f"10.250.{third}.{fourth}/30")
            if not any(candidate.overlaps(network) for network in used):
                return candidate
    raise AssertionError("no free 10.250.x.x/30 on this host")


def _ip_json(netns: str, *args: str) -> Any:
    return json.loads(
        subprocess.run(["ip", "-n", netns, "-j", *args], capture_output=True, check=True).stdout
    )


def test_network_by_ioctls_in_a_network_namespace(netns: str) -> None:
    subnet = _free_test_subnet()
    gateway, address = (str(host) for host in list(subnet.hosts())[:2])
    code = (
        "import sys\n"
        "from auraed.bootargs import BootArgs\n"
        "from auraed.init.pid1 import Pid1\n"
        "init = Pid1(args=BootArgs(ip=sys.argv[1], gateway=sys.argv[2]))\n"
        "init.configure_network()\n"
        "init.configure_network()  # idempotent: same address, the route already there\n"
    )
    configure = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, f"{address}/{subnet.prefixlen}", gateway],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # PID 1 waits for eth0 to appear, as for a virtio_net still probing
    # This kernel has no dummy driver: a veth pair inside the namespace, its peer up for carrier.
    subprocess.run(
        ["ip", "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0"], check=True
    )
    subprocess.run(["ip", "-n", netns, "link", "set", "peer0", "up"], check=True)
    _, err = configure.communicate(timeout=30)
    assert configure.returncode == 0, err

    (eth0,) = _ip_json(netns, "addr", "show", "dev", "eth0")
    assert "UP" in eth0["flags"]
    inet = [a for a in eth0["addr_info"] if a["family"] == "inet"]
    assert [(a["local"], a["prefixlen"], a.get("broadcast")) for a in inet] == [
        (address, subnet.prefixlen, str(subnet.broadcast_address))
    ]
    (lo,) = _ip_json(netns, "link", "show", "dev", "lo")
    assert "UP" in lo["flags"]
    routes = {(r["dst"], r.get("gateway"), r.get("dev")) for r in _ip_json(netns, "-4", "route")}
    # Address and mask were set while eth0 was down: no classful 10.0.0.0/8 route ever appeared.
    assert routes == {("default", gateway, "eth0"), (str(subnet), None, "eth0")}


def test_network_arguments_are_validated() -> None:
    from auraed.init import netconf

    assert netconf.parse_cidr("10.250.0.2/30") == ("10.250.0.2", 30)
    assert netconf.parse_cidr("10.250.0.2") == ("10.250.0.2", 32)
    for bad in ("10.250.0.2/33", "10.250.0/30", "10.250.0.256/30", "1/8", "10.0.0.1/x", "10.0.0.1/-1"):
        with pytest.raises(ValueError):
            netconf.parse_cidr(bad)
    assert netconf.netmask(30) == "255.255.255.252" and netconf.netmask(0) == "0.0.0.0"
    assert netconf.broadcast("10.250.0.2", 30) == "10.250.0.3"


def test_hostname_in_a_uts_namespace() -> None:
    code = (
        "import socket\n"
        "from auraed.bootargs import BootArgs\n"
        "from auraed.init.pid1 import Pid1\n"
        "args = BootArgs.parse('console=ttyS0 auraed.role=guest auraed.hostname=guest-7')\n"
        "Pid1(args=args).set_hostname()\n"
        "print(socket.gethostname())\n"
    )
    done = subprocess.run(
        ["unshare", "--uts", sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "guest-7"


def test_config_disk_is_mounted_read_only_before_the_config_is_loaded(pki: PkiPaths, tmp_path: Path) -> None:
    image = config_disk(pki, tmp_path, 'tcp_listen = "10.250.9.2:8080"\nlog_level = "DEBUG"\n')
    loop = subprocess.run(
        ["losetup", "--find", "--show", "--read-only", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    root = tmp_path / "root"
    root.mkdir()
    code = (
        "import json, os, sys\n"
        "from auraed.config import load_config\n"
        "from auraed.bootargs import BootArgs\n"
        "from auraed.init.pid1 import Pid1, Pid1Layout\n"
        "root, device = sys.argv[1], sys.argv[2]\n"
        "host = Pid1(Pid1Layout(root=root, config_device=device), BootArgs())\n"
        "host.mount_config_disk()  # a host without auraed.config_disk= has no config disk\n"
        "assert not os.path.ismount(root + '/etc/aurae')\n"
        "guest = Pid1(Pid1Layout(root=root, config_device=device), BootArgs(role='guest'))\n"
        "guest.mount_config_disk()\n"
        "guest.mount_config_disk()  # idempotent\n"
        "config = load_config(['--config', root + '/etc/aurae/auraed.toml'])\n"
        "try:\n"
        "    open(root + '/etc/aurae/new', 'w')\n"
        "    writable = True\n"
        "except OSError:\n"
        "    writable = False\n"
        "mounts = [l.split() for l in open('/proc/self/mountinfo') if l.split()[4] == root + '/etc/aurae']\n"
        "print(json.dumps({'tcp_listen': config.tcp_listen, 'writable': writable, 'mounts': len(mounts),\n"
        "    'fstype': mounts[0][mounts[0].index('-') + 1], 'options': mounts[0][5],\n"
        "    'key': open(root + '/etc/aurae/pki/server.key').read()[:30]}))\n"
    )
    try:
        done = subprocess.run(
            ["unshare", "--mount", sys.executable, "-c", code, str(root), loop],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
    finally:
        subprocess.run(["losetup", "--detach", loop], check=False)
    assert result["tcp_listen"] == "10.250.9.2:8080"
    assert result["writable"] is False
    assert result["mounts"] == 1
    assert result["fstype"] == "squashfs"
    assert result["options"].startswith("ro,")
    assert result["key"].startswith("-----BEGIN")
    assert not os.path.ismount(root / "etc/aurae")  # the private mount namespace took it along


def test_config_disk_by_serial(tmp_path: Path) -> None:
    for disk, serial in (("vda", "root"), ("vdb", "aurae-config"), ("vdc", "")):
        (tmp_path / "block" / disk).mkdir(parents=True)
        (tmp_path / "block" / disk / "serial").write_text(serial + "\n")
    assert pid1.find_block_device("serial=aurae-config", str(tmp_path), "/dev") == "/dev/vdb"
    assert pid1.find_block_device("serial=missing", str(tmp_path), "/dev") == ""
    assert pid1.find_block_device("/dev/null") == "/dev/null"
    assert pid1.find_block_device("/dev/no-such-disk") == ""


def test_cgroup2_controllers_are_enabled_in_one_write(tmp_path: Path) -> None:
    # A stand-in directory: enabling controllers on this host's real cgroup2 root would change the
    # host. Regular files only record the write (the kernel would then list the enabled ones).
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    enable_controllers(str(tmp_path))
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpuset +cpu +io +hugetlb +pids +rdma +misc"


def test_boot_arguments_and_the_final_action_here() -> None:
    args = BootArgs.parse(
        "console=ttyS0 auraed.role=guest auraed.hostname=g1 auraed.ip=10.250.0.2/30 "
        "auraed.gateway=10.250.0.1 quiet -- auraed.role=host"
    )
    assert args == BootArgs(role="guest", hostname="g1", ip="10.250.0.2/30", gateway="10.250.0.1")
    assert args.guest and not args.poweroff
    assert BootArgs.parse("auraed.poweroff=1 auraed.iface=ens3 auraed.config_disk=/dev/vdc") == BootArgs(
        iface="ens3", config_disk="/dev/vdc", poweroff=True
    )
    # This test process is not PID 1: whatever the arguments, PID 1's end would only be an exit.
    assert Pid1(args=BootArgs(role="guest", poweroff=True)).final_action() == "exit"
    assert pid1.in_initial_pid_namespace()  # this machine's own namespace ...
    assert not pid1.is_machine_init()  # ... but not its init


def test_power_off_is_refused_unless_pid1_serves() -> None:
    with pytest.raises(AuraeError) as refused:
        Pid1().power_off("test")
    assert refused.value.kind.value == "failed_precondition"


def test_layout_from_the_environment() -> None:
    assert Pid1Layout.from_env({}) == Pid1Layout()
    layout = Pid1Layout.from_env({"AURAED_PID1_ROOT": "/tmp/r", "AURAED_PID1_POWER_BUTTON": "/a:/b"})
    assert layout.root == "/tmp/r" and layout.power_buttons == ("/a", "/b")
    assert not layout.enable_controllers  # never on a test root: the hierarchy is the host's
    assert layout.path("sys/fs/cgroup") == "/tmp/r/sys/fs/cgroup"


def test_pid1_module_imports_stay_lean() -> None:
    """PID 1 runs under emulation in guests (~10x per import): before it has mounted, configured and
    read its configuration it needs no asyncio, no subprocess, no parser of addresses."""
    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import auraed.init.pid1\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    imported = set(json.loads(done.stdout))
    assert "auraed.init.pid1" in imported
    for heavy in ("asyncio", "grpc", "subprocess", "ipaddress", "pyroute2", "dataclasses", "auraed.config"):
        assert heavy not in imported, heavy
