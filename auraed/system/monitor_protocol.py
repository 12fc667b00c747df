"""What auraed and a monitor (auraed.system.monitor) tell each other:

- the spec, auraed to monitor: a JSON file (MonitorSpec.to_json) whose path is the monitor's first
  argument;
- the report, monitor to auraed: one JSON line on the sync fd (encode_report, parse_report),
  ``{"pid": N, "start_ticks": T}`` once the process runs or ``{"error": ..., "errno": N}`` when it
  could not start; EOF without a line when the monitor died first;
- the exit record, monitor to auraed: exit.json, written atomically once the process has ended
  (write_exit_record, read_exit_record);
- SIGUSR1, auraed to monitor: reopen the log file (log rotation, CRI ReopenContainerLog). The
  monitor has done so once it holds the file now at the log's path open (holds_open); until then
  auraed sends it again, since one that comes while the monitor starts is ignored.

JSON goes through the tiny codec here (dumps, loads), not the json package, which would cost the
monitor ~10 ms (re, enum, collections) natively and ~10x that in emulated guests.
"""

from __future__ import annotations

import os

from auraed.system.monitor_io import write_all

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

START_FAILED_EXIT_CODE = 127
"""The exit code of a process that could not be started (as a shell's for a command not found)."""

_INF = float("inf")


# --------------------------------------------------------------------------------------- tiny JSON


def _encode_str(value: str) -> str:
    try:
        from _json import encode_basestring_ascii
    except ImportError:  # pragma: no cover - CPython always has _json
        from json.encoder import py_encode_basestring_ascii as encode_basestring_ascii
    return encode_basestring_ascii(value)


def dumps(obj: object) -> str:
    """json.dumps for None/bool/int/float/str/list/tuple/dict without importing json (and re)."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        if not -_INF < obj < _INF:  # NaN and infinities are not JSON
            return "null"
        return float.__repr__(obj)
    if isinstance(obj, str):
        return _encode_str(obj)
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{_encode_str(str(k))}: {dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list | tuple):
        return "[" + ", ".join(dumps(v) for v in obj) + "]"
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


class _ScanContext:
    """The attributes _json.make_scanner reads from a json.JSONDecoder."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity


def loads(text: str) -> Any:
    """json.loads through the C scanner, falling back to the json package (errors, other Pythons)."""
    try:
        from _json import make_scanner

        scan = make_scanner(_ScanContext())  # type: ignore[arg-type]
        start = len(text) - len(text.lstrip())
        value, end = scan(text, start)
        if text[end:].strip():
            raise ValueError("extra data")
        return value
    except Exception:
        import json

        return json.loads(text)


# ------------------------------------------------------------------------------------ the messages


class MonitorSpec:
    """What the monitor should run; ``to_json()`` is the SPEC_JSON_PATH file's content.

    ``log_path`` "": pass-through, argv inherits the monitor's stdin/stdout/stderr. ``pid_file``:
    argv is an OCI runtime command (``create --pid-file``, ``exec --detach --pid-file``) and the
    process to supervise is the pid it writes there (implies ``subreaper``; ``cwd``, uid/gid,
    cgroups and namespaces do not apply). ``console_socket``:
    the path given to the runtime as ``--console-socket``; the terminal's output is logged as stdout.
    ``runtime_starts``: the pid_file command also starts the process (``run --detach``).
    ``stdin`` (pid_file mode without a console): the process's stdin is a pipe the monitor holds
    open, reported as ``input_fd`` (see auraed.system.monitor).
    """

    __slots__ = (
        "argv",
        "cgroup_join_files",
        "console_socket",
        "cwd",
        "env",
        "exit_path",
        "gid",
        "hostname",
        "log_path",
        "netns_path",
        "new_ipc_ns",
        "new_mount_ns",
        "new_pid_ns",
        "new_uts_ns",
        "oom_counter_file",
        "pid_file",
        "runtime_starts",
        "stdin",
        "subreaper",
        "uid",
    )

    def __init__(
        self,
        *,
        argv: list[str],
        log_path: str,
        exit_path: str,
        env: list[str] | None = None,
        cwd: str = "/",
        uid: int | None = None,
        gid: int | None = None,
        cgroup_join_files: list[str] | None = None,
        oom_counter_file: str | None = None,
        new_pid_ns: bool = False,
        new_mount_ns: bool = False,
        new_uts_ns: bool = False,
        new_ipc_ns: bool = False,
        hostname: str | None = None,
        netns_path: str | None = None,
        subreaper: bool = False,
        pid_file: str | None = None,
        console_socket: str | None = None,
        runtime_starts: bool = False,
        stdin: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.env = list(env) if env is not None else []
        self.cwd = cwd
        self.uid = uid
        self.gid = gid
        self.cgroup_join_files = list(cgroup_join_files) if cgroup_join_files else []
        self.oom_counter_file = oom_counter_file
        self.log_path = log_path
        self.exit_path = exit_path
        self.new_pid_ns = new_pid_ns
        self.new_mount_ns = new_mount_ns
        self.new_uts_ns = new_uts_ns
        self.new_ipc_ns = new_ipc_ns
        self.hostname = hostname
        self.netns_path = netns_path
        self.subreaper = subreaper
        self.pid_file = pid_file
        self.console_socket = console_socket
        self.runtime_starts = runtime_starts
        self.stdin = stdin

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}

    def to_json(self) -> str:
        return dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MonitorSpec:
        return cls(**{name: data[name] for name in cls.__slots__ if name in data})

    @classmethod
    def from_json(cls, text: str) -> MonitorSpec:
        return cls.from_dict(loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MonitorSpec) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MonitorSpec({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


class ExitRecord:
    """exit.json: how the executable ended. ``exit_code`` is None when it died by ``signal``."""

    __slots__ = ("error", "exit_code", "finished_at", "oom_killed", "signal", "started_at")

    def __init__(
        self,
        *,
        exit_code: int | None,
        signal: int | None,
        oom_killed: bool,
        started_at: float,
        finished_at: float,
        error: str | None = None,
    ) -> None:
        self.exit_code = exit_code
        self.signal = signal
        self.oom_killed = oom_killed
        self.started_at = started_at
        self.finished_at = finished_at
        self.error = error

    @property
    def cri_exit_code(self) -> int:
        """The shell/CRI convention: the exit code, or 128 + signal number."""
        if self.exit_code is not None:
            return self.exit_code
        return 128 + self.signal if self.signal is not None else -1

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExitRecord) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ExitRecord({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


def read_exit_record(path: str | os.PathLike[str]) -> ExitRecord | None:
    """The monitor's exit.json, or None while it does not exist (or is unreadable/garbage)."""
    try:
        with open(path, "rb") as f:
            data = loads(f.read().decode())
        return ExitRecord(
            exit_code=data.get("exit_code"),
            signal=data.get("signal"),
            oom_killed=bool(data.get("oom_killed")),
            started_at=float(data["started_at"]),
            finished_at=float(data["finished_at"]),
            error=data.get("error"),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_exit_record(path: str, record: ExitRecord) -> None:
    """exit.json, atomically: a reader finds all of it or none. ``error`` only when there is one."""
    data: dict[str, object] = {
        "exit_code": record.exit_code,
        "signal": record.signal,
        "oom_killed": record.oom_killed,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
    }
    if record.error is not None:
        data["error"] = record.error
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, (dumps(data) + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def encode_report(message: dict[str, object]) -> bytes:
    """The report's line, as the monitor writes it on its sync fd."""
    return (dumps(message) + "\n").encode()


def parse_report(line: bytes) -> dict[str, Any]:
    """A monitor's sync report: {"pid": N, "start_ticks": T} (and "input_fd": FD, see
    MonitorSpec's ``stdin``) or {"error": ..., "errno": N}."""
    if not line.strip():
        return {"error": "the monitor exited without reporting (see monitor.log in the run directory)"}
    try:
        report = loads(line.decode().strip().splitlines()[0])
    except (ValueError, UnicodeDecodeError):
        return {"error": f"the monitor reported garbage: {line[:200]!r}"}
    return dict(report) if isinstance(report, dict) else {"error": f"the monitor reported {report!r}"}


def holds_open(pid: int, file: os.stat_result) -> bool:
    """Whether process ``pid`` has ``file`` (that inode, whatever its name now) open: how auraed
    sees that a monitor reopened its log."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            opened = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if (opened.st_dev, opened.st_ino) == (file.st_dev, file.st_ino):
            return True
    return False
