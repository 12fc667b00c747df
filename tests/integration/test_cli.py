"""``aer`` end to end: the command line run as a subprocess against a real auraed."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from auraed.client import load_client_config
from auraed.client.cli.arguments import size
from auraed.client.client import client_config_text
from auraed.pki import ensure_dev_pki
from tests.conftest import DaemonProcess, free_all_cells
from tests.support.interrupt import interruptible

AER = [sys.executable, "-m", "auraed.aer"]


def environment(home: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AURAE_CONFIG"}
    env["COLUMNS"] = "200"  # rich wraps at 80 columns when stdout is not a terminal
    if home is not None:
        env["HOME"] = str(home)
    return env


def aer(*args: str, config: Path | None = None, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [*AER, *(["--config", str(config)] if config else []), *args]
    return subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=90, env=environment(home)
    )


def ok(*args: str, config: Path) -> str:
    result = aer(*args, config=config)
    assert result.returncode == 0, f"aer {' '.join(args)}: {result.returncode}\n{result.stderr}"
    return result.stdout


def ok_json(*args: str, config: Path) -> Any:
    return json.loads(ok(*args, "--json", config=config))


def assert_one_line_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("aer: ") and result.stderr.count("\n") == 1, result.stderr
    assert needle in result.stderr


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def config(daemon: DaemonProcess, tmp_path: Path) -> Path:
    """An Aurae-style client config for ``daemon``."""
    crt, key = daemon.pki.clients["aurae-client"]
    path = tmp_path / "aer-config"
    path.write_text(client_config_text(daemon.pki.ca_crt, crt, key, daemon.socket))
    return path


def find_executable(listing: dict[str, Any], cell: str, name: str) -> dict[str, Any]:
    def walk(nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
        for node in nodes:
            for executable in node["executables"]:
                if executable["cell_name"] == cell and executable["name"] == name:
                    return dict(executable)
            found = walk(node["children"])
            if found is not None:
                return found
        return None

    found = walk(listing["cells"])
    assert found is not None, f"{cell}/{name} not in {listing}"
    return found


def wait_exited(config: Path, cell: str, name: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = find_executable(ok_json("cell", "list", config=config), cell, name)
        if status["state"] == "EXECUTABLE_STATE_EXITED":
            return status
        time.sleep(0.1)
    raise AssertionError(f"{cell}/{name} did not exit")


def test_discovery_table_and_json(config: Path) -> None:
    table = ok("discovery", config=config)
    assert "hostname" in table and "aurae.cells.v0.CellService" in table
    reply = ok_json("discovery", config=config)
    assert reply["role"] in ("host", "guest", "nested")
    assert "aurae.observe.v0.ObserveService" in reply["services"]
    assert reply["capabilities"]["cgroup_layout"].startswith("CGROUP_LAYOUT_")


def test_health_exit_code(config: Path) -> None:
    assert ok("health", config=config).strip() == "SERVING"
    assert ok_json("health", "aurae.cells.v0.CellService", config=config)["status"] == "SERVING"
    assert_one_line_error(aer("health", "no.such.Service", config=config), "NOT_FOUND")


def test_cell_lifecycle(config: Path) -> None:
    cell = unique("cli")
    reply = ok_json(
        "cell", "allocate", cell, "--cpu-weight", "100", "--memory-max", "64M", "--pids-max", "50",
        config=config,
    )  # fmt: skip
    assert reply["cell_name"] == cell and reply["cgroup_path"].endswith(f"/{cell}")

    ok("cell", "start", cell, "greeter", "--shell", "echo hi", "--env", "A=1", config=config)
    status = wait_exited(config, cell, "greeter")
    assert status["exit_code"] == 0 and status["signal"] is None and not status["oom_killed"]
    assert ok("observe", "logs", cell, "greeter", config=config).splitlines() == ["hi"]
    lines = ok("observe", "logs", cell, "greeter", "--stdout", "--json", config=config).splitlines()
    assert [json.loads(line)["line"] for line in lines] == ["hi"]

    # Options before "--" and the program after it (argparse alone would reject this order).
    ok("cell", "start", cell, "sleeper", "--env", "X=1", "--", "sleep", "60", config=config)
    tree = ok("cell", "list", config=config)
    assert cell in tree and "memory.max=64Mi" in tree and "pids.max=50" in tree
    assert "EXITED (code 0)" in tree and "RUNNING" in tree and "sleep 60" in tree
    stopped = ok_json("cell", "stop", cell, "sleeper", "--grace", "1", config=config)["status"]
    assert stopped["state"] == "EXECUTABLE_STATE_EXITED" and stopped["signal"] == signal.SIGTERM

    ok("cell", "free", cell, "--grace", "1", config=config)
    listing = ok_json("cell", "list", config=config)
    assert all(node["cell"]["name"] != cell for node in listing["cells"])


def test_follow_ends_quietly_on_ctrl_c(config: Path) -> None:
    cell = unique("cli")
    ok("cell", "allocate", cell, config=config)
    ok("cell", "start", cell, "talker", "--shell", "echo one; exec sleep 60", config=config)
    command = [*AER, "--config", str(config), "observe", "logs", cell, "talker", "--follow"]
    follower = subprocess.Popen(
        interruptible(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
    )
    try:
        assert follower.stdout is not None and follower.stdout.readline() == "one\n"
        follower.send_signal(signal.SIGINT)
        _, stderr = follower.communicate(timeout=20)
    finally:
        follower.kill()
    assert follower.returncode == 130 and stderr == ""
    ok("cell", "free", cell, "--grace", "1", config=config)


def test_observe_daemon_and_signals(config: Path) -> None:
    lines = ok("observe", "daemon", "--tail", "3", "--json", config=config).splitlines()
    assert 0 < len(lines) <= 3 and all(json.loads(line)["item"] == "auraed" for line in lines)

    cell = unique("cli")
    ok("cell", "allocate", cell, config=config)
    ok("cell", "start", cell, "sleeper", "--", "sleep", "60", config=config)
    ok("cell", "stop", cell, "sleeper", "--grace", "1", config=config)
    # The signals stream never ends by itself: a deadline ends it after the recorded signals came.
    result = aer("observe", "signals", "--workload", f"{cell}/sleeper", "--past", "--json", "--timeout", "2",
                 config=config)  # fmt: skip
    assert "DEADLINE_EXCEEDED" in result.stderr
    signals = [json.loads(line) for line in result.stdout.splitlines()]
    assert {"signal_name": "SIGTERM", "how": "sent"}.items() <= signals[0].items()
    ok("cell", "free", cell, config=config)


def test_server_errors_are_one_line(config: Path) -> None:
    assert_one_line_error(aer("cell", "allocate", "Bad_Name", config=config), "INVALID_ARGUMENT")
    assert_one_line_error(aer("cell", "free", unique("missing"), config=config), "NOT_FOUND")
    # A daemon that is not its machine's init never changes the machine's network.
    assert_one_line_error(aer("network", "ls", config=config), "FAILED_PRECONDITION")
    assert_one_line_error(aer("vm", "resize", unique("missing"), "--vcpus", "2", config=config), "NOT_FOUND")


def test_local_errors(tmp_path: Path) -> None:
    assert_one_line_error(aer("cell", "list", home=tmp_path), "no client config")
    assert_one_line_error(aer("discovery", config=tmp_path / "nope"), str(tmp_path / "nope"))
    usage = aer("cell", "allocate", "x", "--memory-max", "12Q", config=tmp_path / "nope")
    assert usage.returncode == 2 and "invalid size '12Q'" in usage.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("64M", 64 << 20),
        ("1G", 1 << 30),
        ("512Ki", 512 << 10),
        ("64MiB", 64 << 20),
        ("2k", 2048),
    ],
)
def test_size_suffixes(text: str, expected: int) -> None:
    assert size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "1.5G", "-1", "5i", "12Q", "99999999999P"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        size(text)


def test_pki_init_and_client(tmp_path: Path) -> None:
    directory = tmp_path / "pki"
    socket = tmp_path / "run" / "aurae.sock"
    out = aer("pki", "init", str(directory), "--client", "alice", "--socket", str(socket), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["config"] == str(directory / "config")
    assert (directory.stat().st_mode & 0o777) == 0o700
    for key in ("ca.key", "server.key", "alice.key"):
        assert ((directory / key).stat().st_mode & 0o777) == 0o600
    config = load_client_config(directory / "config")
    assert config.address == f"unix:{socket}"
    assert config.client_crt == directory / "alice.crt" and config.ca_crt == directory / "ca.crt"

    ca_before = (directory / "ca.crt").read_bytes()
    assert aer("pki", "init", str(directory), "--client", "alice", "--socket", str(socket)).returncode == 0
    assert (directory / "ca.crt").read_bytes() == ca_before  # kept, not recreated

    assert aer("pki", "client", str(directory), "bob").returncode == 0
    assert ((directory / "bob.key").stat().st_mode & 0o777) == 0o600
    assert_one_line_error(aer("pki", "client", str(directory), "bob"), "already exists")
    assert_one_line_error(aer("pki", "client", str(directory), "ca"), "would overwrite")


def test_daemon_started_with_pki_init_files(tmp_path: Path) -> None:
    directory, root = tmp_path / "pki", tmp_path / "daemon"
    root.mkdir()
    socket = root / "run" / "aurae.sock"
    assert aer("pki", "init", str(directory), "--socket", str(socket)).returncode == 0
    daemon = DaemonProcess(root, ensure_dev_pki(directory), [])  # ensure_dev_pki keeps the files
    assert daemon.socket == socket
    daemon.start()
    try:
        assert ok("health", config=directory / "config").strip() == "SERVING"
    finally:
        daemon.stop()
        free_all_cells(daemon)


def test_failures_to_connect_are_worded_in_the_client_configs_terms(tmp_path: Path) -> None:
    """One line each, naming the file or setting to look at; grpc's own log lines stay quiet."""
    ours, theirs, root = tmp_path / "ours", tmp_path / "theirs", tmp_path / "daemon"
    root.mkdir()
    socket = root / "run" / "aurae.sock"
    for directory in (ours, theirs):
        assert aer("pki", "init", str(directory), "--socket", str(socket)).returncode == 0
    daemon = DaemonProcess(root, ensure_dev_pki(ours), [])
    daemon.start()
    try:
        # Our CA, a client certificate from another: the daemon hangs up during the handshake.
        mixed = tmp_path / "mixed"
        mixed.write_text(
            (ours / "config").read_text().replace(str(ours / "aurae-client"), str(theirs / "aurae-client"))
        )
        result = aer("health", config=mixed)
        assert_one_line_error(result, f"may not accept the client certificate {theirs / 'aurae-client.crt'}")
        # Another CA altogether: the daemon's certificate is not signed by it.
        result = aer("health", config=theirs / "config")
        assert_one_line_error(result, f"its certificate is not signed by the CA in {theirs / 'ca.crt'}")
        # Our CA, but a server name the daemon's certificate does not carry.
        renamed = tmp_path / "renamed"
        renamed.write_text(
            (ours / "config").read_text().replace("[system]", '[system]\nserver_name = "elsewhere"')
        )
        assert_one_line_error(aer("health", config=renamed), "its certificate does not name 'elsewhere'")
    finally:
        daemon.stop()
        free_all_cells(daemon)
    result = aer("health", config=ours / "config")
    assert_one_line_error(result, f"cannot reach auraed at unix:{socket}: nothing accepts connections there")


def test_the_example_client_runs_a_command_in_a_cell(config: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "cells_client.py"
    result = subprocess.run(
        [sys.executable, str(example), "--config", str(config)],
        check=False, capture_output=True, text=True, timeout=90, env=environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # isolate_process: the cell's hostname, and PID 2 of its own namespace (under its init).
    assert result.stdout == "hello from example, pid 2\n"
