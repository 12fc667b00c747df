"""Shared pieces of the benchmarks: a dev PKI, a real auraed subprocess, statistics and output.

Each benchmark is a script run from the repository root (``.venv/bin/python bench/<name>.py``); it
imports this module as its sibling. Nothing here imports from ``tests/``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from auraed.client import AuraeClient, ClientConfig
from auraed.pki import PkiPaths, ensure_dev_pki

CGROUP_ROOT = Path("/sys/fs/cgroup")
CLIENT_IDENTITY = "aurae-client"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


# ------------------------------------------------------------------------------ process set-up


def exit_on_sigterm() -> None:
    """Make SIGTERM behave like Ctrl-C, so every ``finally`` (and so every clean-up) runs."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_pki(directory: Path) -> PkiPaths:
    """A throw-away CA with server and client certificates, as `aer pki init` would make them."""
    return ensure_dev_pki(directory / "pki", client_names=(CLIENT_IDENTITY,))


def client_config(pki: PkiPaths, socket: Path) -> ClientConfig:
    crt, key = pki.clients[CLIENT_IDENTITY]
    return ClientConfig(ca_crt=pki.ca_crt, client_crt=crt, client_key=key, address=f"unix:{socket}")


class Daemon:
    """One real auraed started as a subprocess, with its own socket, state, runtime dir and cgroup base.

    ``config_text`` is its TOML config file (empty: every default). ``stop()`` is safe to call any
    number of times; ``cleanup()`` stops the daemon and removes whatever cgroups it may have left
    (it also frees cells itself on shutdown).
    """

    def __init__(
        self, root: Path, pki: PkiPaths, *extra_args: str, log_level: str = "INFO", config_text: str = ""
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.pki = pki
        self.socket = root / "run" / "aurae.sock"
        self.cri_socket = root / "run" / "cri.sock"
        self.cgroup_base = f"aurae-bench-{os.getpid()}"
        self.log_path = root / "auraed.log"
        config = root / "auraed.toml"
        config.write_text(config_text)  # never pick up /etc/aurae/auraed.toml
        self.args = [
            sys.executable, "-m", "auraed",
            "--config", str(config),
            "--socket", str(self.socket),
            "--cri-socket", str(self.cri_socket),
            "--ca-crt", str(pki.ca_crt),
            "--server-crt", str(pki.server_crt),
            "--server-key", str(pki.server_key),
            "--state-dir", str(root / "state"),
            "--runtime-dir", str(root / "run"),
            "--cgroup-base", self.cgroup_base,
            "--free-cells-on-shutdown",
            "--log-level", log_level,
            *extra_args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"auraed exited with {self.process.returncode}:\n{self.log()}")
            if "serving on unix:" in self.log():
                return
            time.sleep(0.05)
        raise RuntimeError(f"auraed did not become ready in {READY_TIMEOUT:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self) -> AuraeClient:
        return AuraeClient.connect(self.client_config())

    def client_config(self) -> ClientConfig:
        return client_config(self.pki, self.socket)

    def stop(self) -> None:
        stop_process(self.process)

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            remove_cgroup_base(self.cgroup_base)


def stop_process(process: subprocess.Popen[Any] | None, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL if it has not exited in ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_exit(process: subprocess.Popen[Any], timeout: float) -> int:
    """Wait for a child to exit, woken by its pidfd the moment it does.

    ``Popen.wait(timeout=...)`` polls with growing sleeps (0.5 ms up to 50 ms), which would add
    up to milliseconds to what is being measured.
    """
    fd = os.pidfd_open(process.pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        raise subprocess.TimeoutExpired(process.args, timeout)
    return process.wait()


def remove_cgroup_base(base: str) -> None:
    """Kill whatever runs below ``<hierarchy>/<base>`` in every hierarchy and remove it all."""
    if not CGROUP_ROOT.is_dir():
        return
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / base
        if not top.is_dir():
            continue
        below = [p for p in top.rglob("*") if p.is_dir()]
        for directory in [*sorted(below, key=lambda p: len(p.parts), reverse=True), top]:
            _kill_cgroup_procs(directory)
            with contextlib.suppress(OSError):
                directory.rmdir()


def _kill_cgroup_procs(directory: Path) -> None:
    procs = directory / "cgroup.procs"
    with contextlib.suppress(OSError):
        for pid in procs.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if not procs.read_text().strip():
                return
        time.sleep(0.01)


# ------------------------------------------------------------------------------ statistics


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted data, interpolating linearly (numpy's default)."""
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    """n, p50, p90, p99, mean, min, max and stdev of durations given in seconds, in milliseconds."""
    ms = sorted(s * 1000.0 for s in seconds)
    n = len(ms)
    mean = sum(ms) / n if n else math.nan
    stdev = math.sqrt(sum((x - mean) ** 2 for x in ms) / (n - 1)) if n > 1 else 0.0
    return {
        "n": n,
        "p50_ms": round(percentile(ms, 50), 4),
        "p90_ms": round(percentile(ms, 90), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "mean_ms": round(mean, 4),
        "min_ms": round(ms[0], 4) if ms else math.nan,
        "max_ms": round(ms[-1], 4) if ms else math.nan,
        "stdev_ms": round(stdev, 4),
    }


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3) if denominator else math.inf


# ------------------------------------------------------------------------------ output


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.partition(":")[2].strip()
                break
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    table = Table(title=title, title_justify="left")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(_cell(value) for value in row))
    Console(width=120).print(table)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def print_lines(lines: Sequence[str]) -> None:
    for line in lines:
        print(line)


def print_json(result: dict[str, Any]) -> None:
    """The machine-readable result: always the last line of output."""
    print(json.dumps(result, separators=(",", ":")), flush=True)
