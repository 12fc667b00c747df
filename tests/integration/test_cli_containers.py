"""``aer image`` and ``aer container`` end to end: the CLI as a subprocess against a real auraed."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import betterproto2
import pytest

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.client import ClientError
from auraed.client.client import client_config_text
from tests.conftest import DaemonProcess
from tests.integration.test_cli import AER, assert_one_line_error, environment, unique
from tests.integration.test_cli_edges import run_with_stdin_closed
from tests.support.images import BuiltImage, push_layout
from tests.support.interrupt import interruptible
from tests.support.registry import LocalRegistry

BUSYBOX = "localhost/busybox:cli"
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def config(daemon: DaemonProcess, tmp_path: Path) -> Path:
    crt, key = daemon.pki.clients["aurae-client"]
    path = tmp_path / "aer-config"
    path.write_text(client_config_text(daemon.pki.ca_crt, crt, key, daemon.socket))
    return path


def aer(
    *args: str,
    config: Path,
    stdin: str | int | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``aer --config CONFIG ARGS``; ``stdin`` is text to send, or a file descriptor to read from."""
    return subprocess.run(
        [*AER, "--config", str(config), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(),
        cwd=cwd,
        input=stdin if isinstance(stdin, str) else None,
        stdin=stdin if isinstance(stdin, int) else None if isinstance(stdin, str) else subprocess.DEVNULL,
    )


def ok(*args: str, config: Path, **options: Any) -> str:
    result = aer(*args, config=config, **options)
    assert result.returncode == 0, f"aer {' '.join(args)}: {result.returncode}\n{result.stderr}"
    return result.stdout


def ok_json(*args: str, config: Path) -> Any:
    return json.loads(ok("--json", *args, config=config))


def containers(config: Path) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in ok_json("container", "ls", config=config)["containers"]}


def wait_for(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.fixture
def loaded(config: Path, busybox_layout: BuiltImage) -> Path:
    """``config``, with the busybox image imported as BUSYBOX."""
    ok("image", "import", str(busybox_layout.layout), "--reference", BUSYBOX, config=config)
    return config


@pytest.fixture
def box(loaded: Path) -> Iterator[str]:
    """A running busybox container that sleeps."""
    name = unique("box")
    ok("container", "create", name, BUSYBOX, "--", "sleep", "300", config=loaded)
    ok("container", "start", name, config=loaded)
    yield name
    aer("container", "rm", "--force", name, config=loaded)


# --------------------------------------------------------------------------- a terminal harness


@dataclass
class TerminalRun:
    returncode: int
    output: bytes
    restored: bool  # the terminal's settings after are those before

    @property
    def text(self) -> str:
        return ANSI.sub(b"", self.output).decode(errors="replace")


@dataclass
class Terminal:
    """Run a command on a new pseudo-terminal (its controlling terminal), and talk to it."""

    rows: int = 40
    columns: int = 100
    steps: list[tuple[bytes, Callable[[int], None]]] = field(default_factory=list)

    def when(self, seen: bytes, action: Callable[[int], None]) -> Terminal:
        """Once ``seen`` is in the output, call ``action`` with the master side's descriptor."""
        self.steps.append((seen, action))
        return self

    @staticmethod
    def resize(fd: int, rows: int, columns: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def run(self, command: list[str], timeout: float = 60) -> TerminalRun:
        master, slave = pty.openpty()
        try:
            self.resize(slave, self.rows, self.columns)
            before = termios.tcgetattr(slave)
            # setsid --ctty: a new session whose controlling terminal is ours (SIGWINCH reaches it).
            process = subprocess.Popen(
                ["setsid", "--ctty", *command], stdin=slave, stdout=slave, stderr=slave, env=environment()
            )
            output, steps = b"", list(self.steps)
            deadline = time.monotonic() + timeout
            try:
                while time.monotonic() < deadline:
                    readable, _, _ = select.select([master], [], [], 0.2)
                    if readable:
                        output += os.read(master, 1 << 16)
                        while steps and steps[0][0] in output:
                            steps.pop(0)[1](master)
                    elif process.poll() is not None:
                        break  # exited, and all it wrote has been read
                else:
                    raise AssertionError(f"{command} did not end; output so far: {output!r}")
            finally:
                process.kill()
                process.wait()
            return TerminalRun(process.returncode, output, termios.tcgetattr(slave) == before)
        finally:
            os.close(master)
            os.close(slave)


# --------------------------------------------------------------------------- images


def test_image_import_ls_inspect(config: Path, busybox_layout: BuiltImage) -> None:
    # A relative path is made absolute on the client's side.
    out = ok(
        "image", "import", busybox_layout.layout.name, "--reference", BUSYBOX,
        config=config, cwd=busybox_layout.layout.parent,
    )  # fmt: skip
    assert out.strip() == f"imported {busybox_layout.config_digest} as {BUSYBOX}"
    imported = ok_json(
        "image", "import", str(busybox_layout.layout), "--ref-name", "latest",
        "--reference", "localhost/other:1", config=config,
    )  # fmt: skip
    assert imported["image"]["id"] == busybox_layout.config_digest
    assert set(imported["image"]["references"]) == {BUSYBOX, "localhost/other:1"}

    table = ok("image", "ls", config=config)
    short = busybox_layout.config_digest.removeprefix("sha256:")[:12]
    row = next(line for line in table.splitlines() if BUSYBOX in line)
    assert short in row and re.search(r"\s1\s", row), table
    listing = ok_json("image", "ls", config=config)["images"]
    assert [image["id"] for image in listing] == [busybox_layout.config_digest]
    assert listing[0]["size"] == str(busybox_layout.total_layer_size)  # uint64: a JSON string

    details = ok("image", "inspect", BUSYBOX, config=config)
    assert busybox_layout.config_digest in details and "/bin/sh" in details and "linux/amd64" in details
    image = ok_json("image", "inspect", BUSYBOX, config=config)
    assert image["id"] == busybox_layout.config_digest
    assert image["layers"] == [layer.digest for layer in busybox_layout.layers]
    assert image["config"]["cmd"] == ["/bin/sh"]


def test_image_errors_are_one_line(config: Path) -> None:
    assert_one_line_error(aer("image", "inspect", "localhost/nope:1", config=config), "NOT_FOUND")
    assert_one_line_error(aer("image", "rm", "localhost/nope:1", config=config), "NOT_FOUND")
    assert_one_line_error(aer("image", "pull", "Bad Name!", config=config), "INVALID_ARGUMENT")
    assert_one_line_error(aer("image", "import", "/nonexistent/layout", config=config), "NOT_FOUND")
    assert_one_line_error(
        aer("image", "pull", "localhost/x:1", "--username", "alice", config=config), "--password-stdin"
    )


# --------------------------------------------------------------------------- pulling


def test_pull_with_progress_then_remove(config: Path, busybox_layout: BuiltImage, tmp_path: Path) -> None:
    with LocalRegistry() as registry:
        reference = f"{registry.host}/cli/busybox:1"
        push_layout(busybox_layout, reference)

        lines = [
            json.loads(line) for line in ok("image", "pull", reference, "--json", config=config).splitlines()
        ]
        *progress, last = lines
        assert last["progress"] is None and last["image"]["id"] == busybox_layout.config_digest
        assert reference in last["image"]["references"]
        phases = [line["progress"]["phase"] for line in progress]
        assert phases[0] == "resolving" and phases[-1] == "done"
        assert progress[-1]["progress"]["done"] == str(busybox_layout.total_layer_size)
        assert "downloading" in phases or "unpacking" in phases

        freed = ok_json("image", "rm", reference, config=config)
        assert int(freed["freed_bytes"]) > 0
        assert ok_json("image", "ls", config=config)["images"] == []

        # Not a terminal: one plain line per progress message, then the image.
        text = ok("image", "pull", reference, config=config).splitlines()
        assert text[0] == "resolving"
        short = busybox_layout.layers[0].digest.removeprefix("sha256:")[:12]
        assert any(re.match(rf"\w+ {short} \S+/\S+ \(total ", line) for line in text), text
        assert text[-1] == f"pulled {busybox_layout.config_digest} as {reference}"
        out = ok("image", "rm", reference, config=config)
        assert re.fullmatch(rf"removed {re.escape(reference)}, freed \S+\n", out), out

        # On a terminal: rich progress bars, then the same summary.
        shown = Terminal(columns=160).run([*AER, "--config", str(config), "image", "pull", reference])
        assert shown.returncode == 0, shown.text
        assert "done" in shown.text and f"pulled {busybox_layout.config_digest}" in shown.text


def test_pull_with_basic_auth_from_stdin(config: Path, busybox_layout: BuiltImage) -> None:
    with LocalRegistry(mode="basic", users={"alice": "s3cret"}) as registry:
        reference = f"{registry.host}/private/busybox:1"
        push_layout(busybox_layout, reference, creds=registry.creds)
        assert_one_line_error(aer("image", "pull", reference, config=config), "PERMISSION_DENIED")
        out = ok("image", "pull", reference, "--username", "alice", "--password-stdin",
                 config=config, stdin="s3cret\n")  # fmt: skip
        assert out.splitlines()[-1] == f"pulled {busybox_layout.config_digest} as {reference}"


# --------------------------------------------------------------------------- run


def test_run_rm_prints_output_and_exits_as_the_container(loaded: Path) -> None:
    name = unique("hi")
    result = aer("container", "run", "--rm", name, BUSYBOX, "--", "echo", "hi", config=loaded)
    assert (result.returncode, result.stdout, result.stderr) == (0, "hi\n", "")
    assert name not in containers(loaded)

    name = unique("three")
    result = aer(
        "container", "run", name, BUSYBOX, "--env", "WHO=world", "--",
        "sh", "-c", "echo hello $WHO; echo oops >&2; exit 3", config=loaded,
    )  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (3, "hello world\n", "oops\n")
    status = ok_json("container", "inspect", name, config=loaded)
    assert status["state"] == "CONTAINER_STATE_EXITED" and status["exit_code"] == 3
    assert "EXITED (code 3)" in ok("container", "inspect", name, config=loaded)
    ok("container", "rm", name, config=loaded)

    # --entrypoint replaces the Entrypoint, the words after -- the Cmd; options are passed on.
    name = unique("opts")
    result = aer(
        "container", "run", "--rm", name, BUSYBOX, "--entrypoint", "sh -c", "--workdir", "/srv",
        "--read-only", "--user", "1000:1000", "--cap-drop", "ALL", "--",
        "pwd; id -u; touch /x 2>/dev/null || echo read-only", config=loaded,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, "/srv\n1000\nread-only\n"), result.stderr


def test_logs_keep_their_order_when_stdout_and_stderr_go_to_one_file(loaded: Path, tmp_path: Path) -> None:
    """A message carries many lines: those of both streams must still come out in the log's order."""
    name = unique("mixed")
    # Pairs 0.1 s apart: the monitor logs them interleaved (it reads the two pipes as they fill).
    script = "for i in 1 2 3 4 5 6; do echo out$i; echo err$i >&2; sleep 0.1; done"
    ok("container", "run", name, BUSYBOX, "--", "sh", "-c", script, config=loaded)
    as_json = ok("container", "logs", name, "--json", config=loaded).splitlines()
    logged = [json.loads(line)["line"] for line in as_json]
    assert sorted(logged) == sorted(f"{stream}{i}" for stream in ("out", "err") for i in range(1, 7))
    both = tmp_path / "both"
    with both.open("w") as file:
        command = [*AER, "--config", str(loaded), "container", "logs", name]
        buffered = {k: v for k, v in environment().items() if k != "PYTHONUNBUFFERED"}  # as most users run it
        subprocess.run(command, stdout=file, stderr=subprocess.STDOUT, check=True, env=buffered, timeout=60)
    assert both.read_text().split() == logged
    ok("container", "rm", name, config=loaded)


def test_run_rm_cleans_up_on_ctrl_c(loaded: Path) -> None:
    name = unique("talker")
    command = [*AER, "--config", str(loaded), "container", "run", "--rm", name, BUSYBOX, "--",
               "sh", "-c", "echo up; exec sleep 300"]  # fmt: skip
    runner = subprocess.Popen(
        interruptible(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
    )
    try:
        assert runner.stdout is not None and runner.stdout.readline() == "up\n"
        runner.send_signal(signal.SIGINT)
        _, stderr = runner.communicate(timeout=30)
    finally:
        runner.kill()
    assert (runner.returncode, stderr) == (130, "")
    # aer waits a few seconds for its Delete; the daemon finishes it in any case.
    wait_for(lambda: name not in containers(loaded))


def test_create_start_logs_stop_rm(loaded: Path, tmp_path: Path) -> None:
    name = unique("sleeper")
    created = ok_json(
        "container", "create", name, BUSYBOX, "--label", "suite=cli", "--env", "A=from-env",
        "--memory", "64M", "--pids", "30", "--mount", f"{tmp_path}:/data:ro",
        "--", "sh", "-c", "echo $A; echo to-err >&2; exec sleep 300", config=loaded,
    )["status"]  # fmt: skip
    assert created["state"] == "CONTAINER_STATE_CREATED" and created["labels"] == {"suite": "cli"}
    assert [c["name"] for c in ok_json("container", "ls", "--label", "suite=cli", config=loaded)
            ["containers"]] == [name]  # fmt: skip
    assert ok_json("container", "ls", "--label", "suite=other", config=loaded)["containers"] == []

    assert "started" in ok("container", "start", name, config=loaded)
    wait_for(lambda: "from-env" in ok("container", "logs", name, config=loaded))
    logs = aer("container", "logs", name, config=loaded)
    assert (logs.stdout, logs.stderr) == ("from-env\n", "to-err\n")
    assert ok("container", "logs", name, "--stderr", config=loaded) == ""  # stderr lines go to stderr
    assert aer("container", "logs", name, "--stderr", config=loaded).stderr == "to-err\n"
    assert ok("container", "logs", name, "--stdout", "--tail", "1", config=loaded) == "from-env\n"
    assert ok("container", "logs", name, "--since", "1h", config=loaded) == "from-env\n"
    assert ok("container", "logs", name, "--since", str(int(time.time()) + 3600), config=loaded) == ""
    lines = ok("container", "logs", name, "--json", config=loaded).splitlines()
    assert {(json.loads(line)["stream"], json.loads(line)["line"]) for line in lines} == {
        ("stdout", "from-env"),
        ("stderr", "to-err"),
    }

    table = ok("container", "ls", config=loaded)
    row = next(line for line in table.splitlines() if name in line)
    assert "RUNNING" in row and BUSYBOX in row and "ago" in row
    stats = ok_json("container", "stats", name, config=loaded)
    assert int(stats["memory_current"]) > 0 and int(stats["pids_current"]) >= 1
    assert (stats["memory_max"], stats["pids_max"]) == (str(64 << 20), "30")
    (tmp_path / "marker").write_text("mounted\n")
    assert ok("container", "exec", name, "--", "cat", "/data/marker", config=loaded) == "mounted\n"
    refused = aer("container", "exec", name, "--", "touch", "/data/new", config=loaded)
    assert refused.returncode != 0 and "Read-only" in refused.stderr
    assert "memory" in ok("container", "stats", name, config=loaded)
    top = ok("container", "top", name, config=loaded)
    assert "PID" in top and "sleep 300" in top
    assert [p["args"] for p in ok_json("container", "top", name, config=loaded)["processes"]] == [
        ["sleep", "300"]
    ]
    (tmp_path / "hosts").write_text("10.0.0.9 db\n")
    copied = ok_json(
        "container", "copy-file", str(tmp_path / "hosts"), f"cli/{name}/hosts", "--mode", "600", config=loaded
    )
    assert Path(copied["path"]).read_text() == "10.0.0.9 db\n" and copied["size"] == "12"
    assert Path(copied["path"]).stat().st_mode & 0o777 == 0o600
    bad = aer("container", "copy-file", str(tmp_path / "hosts"), "../out", config=loaded)
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr

    # sleep as PID 1 ignores SIGTERM: SIGKILL after the timeout.
    stopped = ok("container", "stop", name, "--timeout", "0.5", config=loaded)
    assert "stopped" in stopped and "EXITED (SIGKILL)" in stopped
    assert containers(loaded)[name]["signal"] == 9
    assert "removed" in ok("container", "rm", name, config=loaded)
    assert name not in containers(loaded)


def test_kill_and_wait(loaded: Path, box: str) -> None:
    ok("container", "kill", box, "--signal", "SIGKILL", config=loaded)
    assert ok("container", "wait", box, config=loaded) == "137\n"
    assert ok_json("container", "wait", box, config=loaded)["status"]["signal"] == 9
    assert_one_line_error(
        aer("container", "kill", box, "--signal", "SIGBOGUS", config=loaded), "INVALID_ARGUMENT"
    )


def test_a_long_call_shows_what_it_waits_for_on_a_terminal(loaded: Path, box: str) -> None:
    command = [*AER, "--config", str(loaded), "container", "stop", "--timeout", "1.5"]
    # sleep as PID 1 ignores SIGTERM: each stop waits out its grace period.
    stopped = Terminal().run([*command, box])
    assert stopped.returncode == 0, stopped.text
    assert f"stopping container {box} (SIGKILL after 1.5 s)" in stopped.text
    assert f"stopped {box}" in stopped.text
    # Not for scripts: with --json, or when stderr is not a terminal.
    quiet, piped = unique("quiet"), unique("piped")
    for name in (quiet, piped):
        ok("container", "create", name, BUSYBOX, "--", "sleep", "300", config=loaded)
        ok("container", "start", name, config=loaded)
    try:
        as_json = Terminal().run([*command, quiet, "--json"])
        assert as_json.returncode == 0 and "stopping" not in as_json.text, as_json.text
        assert json.loads(as_json.text)["status"]["signal"] == 9
        result = aer("container", "stop", piped, "--timeout", "1.5", config=loaded)
        assert (result.returncode, result.stderr) == (0, "")
    finally:
        for name in (quiet, piped):
            aer("container", "rm", "--force", name, config=loaded)


def test_container_errors_are_one_line(loaded: Path, box: str) -> None:
    assert_one_line_error(
        aer("container", "create", unique("x"), "localhost/nope:1", config=loaded), "NOT_FOUND"
    )
    assert_one_line_error(aer("container", "run", "--rm", unique("x"), "localhost/nope:1", config=loaded),
                          "NOT_FOUND")  # fmt: skip
    assert_one_line_error(aer("container", "create", box, BUSYBOX, config=loaded), "ALREADY_EXISTS")
    assert box in containers(loaded)  # run --rm never removes what it did not create
    assert_one_line_error(aer("container", "create", "Bad_Name", BUSYBOX, config=loaded), "INVALID_ARGUMENT")
    assert_one_line_error(aer("container", "exec", unique("ghost"), "--", "true", config=loaded), "NOT_FOUND")
    assert_one_line_error(aer("container", "exec", box, config=loaded), "give the command")
    assert_one_line_error(aer("container", "rm", box, config=loaded), "FAILED_PRECONDITION")
    usage = aer("container", "create", "x", BUSYBOX, "--mount", "nocolon", config=loaded)
    assert usage.returncode == 2 and "expected SRC:DST[:ro]" in usage.stderr


# --------------------------------------------------------------------------- exec


def test_exec_stdin_output_and_exit_code(loaded: Path, box: str, tmp_path: Path) -> None:
    piped = subprocess.run(
        f"echo hello | {' '.join(AER)} --config {loaded} container exec -i {box} -- cat",
        shell=True, check=False, capture_output=True, text=True, timeout=60, env=environment(),
    )  # fmt: skip
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, "hello\n", "")

    # stdin a regular file: epoll cannot watch it, a thread reads it.
    data = tmp_path / "data"
    data.write_text("line one\nline two\n")
    with data.open() as file:
        counted = ok("container", "exec", "-i", box, "--", "wc", "-l", config=loaded, stdin=file.fileno())
    assert counted.strip() == "2"

    result = aer("container", "exec", box, "--", "sh", "-c", "echo out; echo err >&2; exit 4", config=loaded)
    assert (result.returncode, result.stdout, result.stderr) == (4, "out\n", "err\n")
    # Without -i the process's stdin is at its end at once.
    assert ok("container", "exec", box, "--", "cat", config=loaded, stdin="ignored\n") == ""


def test_exec_passes_a_signal_on_to_the_process(loaded: Path, box: str) -> None:
    """Without a terminal, ^C at aer reaches the exec'd process, which ends as it chooses; its
    exit code is aer's."""
    script = "trap 'echo got-int; exit 5' INT; echo ready; while :; do sleep 0.1; done"
    command = [*AER, "--config", str(loaded), "container", "exec", box, "--", "sh", "-c", script]
    runner = subprocess.Popen(
        interruptible(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment()
    )
    try:
        assert runner.stdout is not None and runner.stdout.readline() == "ready\n"
        runner.send_signal(signal.SIGINT)
        stdout, stderr = runner.communicate(timeout=30)
    finally:
        runner.kill()
    assert (runner.returncode, stdout, stderr) == (5, "got-int\n", "")


def test_exec_on_a_terminal(loaded: Path, box: str) -> None:
    command = [*AER, "--config", str(loaded), "container", "exec"]
    # -t alone: the remote side has a terminal of our size.
    shown = Terminal(rows=40, columns=100).run([*command, "-t", box, "--", "sh", "-c", "tty; stty size"])
    assert shown.returncode == 0, shown.text
    assert re.search(r"/dev/pts/\d+", shown.text) and "40 100" in shown.text and shown.restored

    # -i -t: raw mode, so ^C goes to the container; a resize follows the local terminal.
    script = (
        "trap 'echo got-int; stty size; exit 7' INT; trap 'echo resized' WINCH; echo ready; "
        "while true; do sleep 0.1; done"
    )

    def interrupt(fd: int) -> None:
        os.write(fd, b"\x03")

    interrupted = (
        Terminal()
        .when(b"ready", lambda fd: Terminal.resize(fd, 50, 120))  # SIGWINCH to aer, which sends it
        .when(b"resized", interrupt)  # ^C only once the container has its new size
        .run([*command, "-i", "-t", box, "--", "sh", "-c", script])
    )
    assert interrupted.returncode == 7, interrupted.text
    assert "got-int" in interrupted.text and "50 120" in interrupted.text
    assert interrupted.restored  # raw mode undone

    # The terminal is restored on errors too.
    failed = Terminal().run([*command, "-i", "-t", unique("ghost"), "--", "sh"])
    assert failed.returncode == 1 and "NOT_FOUND" in failed.text and failed.restored


def test_exec_with_stdin_closed_sends_an_ended_input(loaded: Path, box: str) -> None:
    """``aer ... <&-`` starts without a descriptor 0 (sys.stdin is None): -i used to end in a
    traceback."""
    script = "cat; echo done"
    result = run_with_stdin_closed(
        "--config", str(loaded), "container", "exec", "-i", box, "--", "sh", "-c", script
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")


async def test_the_python_clients_snake_case_methods_stream_requests(daemon: DaemonProcess, box: str) -> None:
    """``client.service(...).exec`` and ``.import_image`` take a stream of requests: they used to
    hand it to grpc as one request, which failed with a TypeError."""
    exec_request = containers_pb.ContainerServiceExecRequest
    start = exec_request(start=containers_pb.ExecStart(container_id=box, command=["echo", "hi"]))

    async def one(request: betterproto2.Message) -> AsyncIterator[Any]:
        yield request

    async with daemon.client() as client:
        service = client.service("aurae.containers.v0.ContainerService")
        replies = [reply async for reply in service.exec(one(start), timeout=60)]
        assert b"".join(reply.stdout for reply in replies) == b"hi\n" and replies[-1].exit_code == 0
        with pytest.raises(ClientError) as refused:  # the server's own answer, so it was sent
            await service.import_image(one(containers_pb.ContainerServiceImportImageRequest()), timeout=60)
        assert refused.value.code == "INVALID_ARGUMENT" and "header" in refused.value.message
