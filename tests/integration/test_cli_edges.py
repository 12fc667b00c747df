"""``aer`` given what a careless or unlucky user gives it: each mistake is one line and an exit
status, never a traceback, and nothing of grpc's own logging."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from auraed.client.cli.calls import DEFAULT_TIMEOUT
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.test_cli import AER, aer, assert_one_line_error, config, environment

__all__ = ["config"]  # the fixture, shared with test_cli

USAGE = 2  # argparse's exit status for a malformed command line


def test_an_entrypoint_that_sh_cannot_split_is_a_usage_error(tmp_path: Path) -> None:
    result = aer("container", "create", "x", "img", "--entrypoint", "sh -c 'unclosed", config=tmp_path / "no")
    assert result.returncode == USAGE and "Traceback" not in result.stderr, result.stderr
    assert "argument --entrypoint: cannot split" in result.stderr


def test_vm_numbers_are_checked_before_anything_is_sent(tmp_path: Path) -> None:
    for args in (
        ["vm", "console", "v", "--tail", "-1"],
        ["vm", "allocate", "v", "--vcpus", "-1"],
        ["vm", "resize", "v", "--memory", "-1"],
    ):
        result = aer(*args, config=tmp_path / "no")
        assert result.returncode == USAGE and "is out of range" in result.stderr, result.stderr


def run_with_stdin_closed(*args: str) -> subprocess.CompletedProcess[str]:
    """``aer ARGS <&-``: aer starts with no descriptor 0 at all (sys.stdin is None)."""
    return subprocess.run(
        ["sh", "-c", 'exec "$@" <&-', "sh", *AER, *args],
        check=False, capture_output=True, text=True, timeout=60, env=environment(),
    )  # fmt: skip


def test_a_password_from_a_closed_stdin_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    pull = ["image", "pull", "x", "--username", "u", "--password-stdin"]
    result = run_with_stdin_closed("--config", str(tmp_path / "no"), *pull)
    assert_one_line_error(result, "--password-stdin: no password on stdin")


def broken_config(daemon: DaemonProcess, tmp_path: Path, **files: Path) -> Path:
    """A client config for ``daemon``, with ``files`` in place of its own."""
    crt, key = daemon.pki.clients["aurae-client"]
    chosen = {"ca_crt": daemon.pki.ca_crt, "client_crt": crt, "client_key": key, **files}
    path = tmp_path / f"config-{len(list(tmp_path.iterdir()))}"
    auth = "".join(f'{name} = "{value}"\n' for name, value in chosen.items())
    path.write_text(f'[auth]\n{auth}\n[system]\nsocket = "{daemon.socket}"\n')
    return path


def test_certificates_and_keys_grpc_cannot_use_are_named(daemon: DaemonProcess, tmp_path: Path) -> None:
    """grpc used to log several lines of its own and fail with "Failed to create security
    handshaker", naming no file."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    accented = tmp_path / "accented.pem"
    accented.write_bytes("not a PEM file, café\n".encode())  # not ASCII: aer failed with a TypeError
    other_key = daemon.pki.server_key  # a real key, of another certificate
    cases = {
        f"the CA certificate {junk} holds no PEM certificate": {"ca_crt": junk},
        f"the client certificate {junk} holds no PEM certificate": {"client_crt": junk},
        f"the CA certificate {accented} holds no PEM certificate": {"ca_crt": accented},
        f"the client key {junk} holds no unencrypted PEM private key": {"client_key": junk},
        f"the client key {other_key} is not the key of the client certificate": {"client_key": other_key},
    }
    for message, files in cases.items():
        assert_one_line_error(aer("health", config=broken_config(daemon, tmp_path, **files)), message)


def test_an_address_whose_port_grpc_would_wrap_is_refused(config: Path) -> None:
    """grpc connects to port 99999 modulo 65536 (34463), an empty port as 443."""
    for address in ("localhost:99999", "127.0.0.1:0", "localhost:"):
        result = aer("--address", address, "health", config=config)
        assert_one_line_error(result, f"the address '{address}': the port must be a number from 1 to 65535")
    # grpc's own schemes are not host:port (an abstract socket's name is no port)
    result = aer("--address", f"unix-abstract:aurae-test-{time.monotonic_ns()}", "health", config=config)
    assert_one_line_error(result, "nothing accepts connections there")


def test_an_unknown_health_service_is_named(config: Path) -> None:
    """grpc's health service gives no detail: the line used to be "aer: NOT_FOUND:" alone."""
    result = aer("health", "no.such.Service", config=config)
    assert_one_line_error(result, "NOT_FOUND: no health status for the service 'no.such.Service'")


# Above aer's default deadline of a call (DEFAULT_TIMEOUT, 30 s), within what a daemon may set.
LONG_STOP_GRACE = "35"
READY_TIMEOUT = 20.0  # seconds for the executable to say it ignores SIGTERM


def test_a_stop_waits_out_the_daemons_own_grace_period(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """Without --grace, ``cell stop`` used to give up at 30 s with DEADLINE_EXCEEDED while the
    daemon, whose stop_grace_period was longer, went on and killed the process after it."""
    daemon = daemon_factory("--stop-grace-period", LONG_STOP_GRACE)
    config = broken_config(daemon, tmp_path)  # nothing broken: the daemon's own files
    assert aer("cell", "allocate", "slow", config=config).returncode == 0
    script = "trap '' TERM; echo ready; exec sleep 300"
    start = aer("cell", "start", "slow", "stubborn", "--shell", script, config=config)
    assert start.returncode == 0, start.stderr
    deadline = time.monotonic() + READY_TIMEOUT
    while aer("observe", "logs", "slow", "stubborn", config=config).stdout != "ready\n":  # trap set
        assert time.monotonic() < deadline, "the executable did not start"
        time.sleep(0.1)
    stopped = aer("--json", "cell", "stop", "slow", "stubborn", config=config)
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["status"]["signal"] == signal.SIGKILL


LONG_LOG_LINES = 20_000  # of LONG_LOG_WIDTH characters: more than every buffer between the two sides
LONG_LOG_WIDTH = 1000


def test_a_long_log_is_printed_whole_however_long_it_takes(config: Path) -> None:
    """A log printed slower than DEFAULT_TIMEOUT (a slow reader, a long log) used to end at that
    deadline with DEADLINE_EXCEEDED, the rest never printed."""
    script = f"yes $(printf '%0{LONG_LOG_WIDTH}d' 0) | head -n {LONG_LOG_LINES}"
    assert aer("cell", "allocate", "chatty", config=config).returncode == 0
    assert aer("cell", "start", "chatty", "writer", "--shell", script, config=config).returncode == 0
    deadline = time.monotonic() + READY_TIMEOUT
    while '"EXECUTABLE_STATE_EXITED"' not in aer("--json", "cell", "list", config=config).stdout:
        assert time.monotonic() < deadline, "the writer did not finish"
        time.sleep(0.1)
    reader = subprocess.Popen(
        [*AER, "--config", str(config), "observe", "logs", "chatty", "writer"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
    )  # fmt: skip
    try:
        time.sleep(DEFAULT_TIMEOUT + 2)  # nothing read: aer waits on its stdout, the daemon on aer
        out, err = reader.communicate(timeout=120)
    finally:
        reader.kill()
    assert (reader.returncode, err) == (0, "")
    assert out.count("\n") == LONG_LOG_LINES
