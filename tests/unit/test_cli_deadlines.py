"""The deadline each `aer` command gives its calls: a call whose length grows with an image's size
or with a grace period must not be cut short at the 30 s default while the daemon carries on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from auraed.client.cli import build_parser, calls
from auraed.client.client import AuraeClient, ClientConfig
from auraed.names import MAX_WAIT_MS


class Called(Exception):
    """Ends the command once its first call is seen."""


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []

    async def __aenter__(self) -> Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def call(self, service: str, method: str, request: Any, timeout: float | None = None) -> Any:
        self.calls.append((method, timeout))
        raise Called


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    config = ClientConfig(Path("/ca"), Path("/crt"), Path("/key"), "unix:/nowhere")
    monkeypatch.setattr(calls, "client_config", lambda args: config)
    monkeypatch.setattr(AuraeClient, "connect", staticmethod(lambda config, vm="": recorder))
    return recorder


def first_call(recorder: Recorder, *argv: str) -> tuple[str, float | None]:
    args = build_parser().parse_args(list(argv))
    with pytest.raises(Called):
        args.handler(args)
    return recorder.calls[0]


DEFAULT = calls.DEFAULT_TIMEOUT
LONGEST_GRACE = DEFAULT + MAX_WAIT_MS / 1000  # the daemon's stop_grace_period may be this long


@pytest.mark.parametrize(
    ("argv", "method", "deadline"),
    [
        # An image of any size: no default deadline.
        (["image", "import", "/layout"], "ImportImageLayout", None),
        (["--vm", "g1", "container", "create", "c", "busybox"], "Create", None),
        (["--vm", "g1", "container", "run", "c", "busybox"], "Create", None),
        # On the host, Create sends nothing: the default.
        (["container", "create", "c", "busybox"], "Create", DEFAULT),
        (["container", "run", "c", "busybox"], "Create", DEFAULT),
        # A VM's stop (also Free's, when it runs) waits out the grace given, or the daemon's.
        (["vm", "stop", "g1"], "Stop", LONGEST_GRACE),
        (["vm", "stop", "g1", "--grace", "90"], "Stop", DEFAULT + 90),
        (["vm", "free", "g1"], "Free", LONGEST_GRACE),
        (["vm", "free", "g1", "--grace", "90"], "Free", DEFAULT + 90),
        # --timeout always wins.
        (["--timeout", "5", "image", "import", "/layout"], "ImportImageLayout", 5.0),
        (["--timeout", "5", "vm", "free", "g1"], "Free", 5.0),
    ],
)
def test_deadlines(recorder: Recorder, argv: list[str], method: str, deadline: float | None) -> None:
    assert first_call(recorder, *argv) == (method, deadline)


def test_vm_grace_goes_to_the_daemon_in_milliseconds(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Any] = []

    async def call(service: str, method: str, request: Any, timeout: float | None = None) -> Any:
        sent.append(request)
        raise Called

    monkeypatch.setattr(recorder, "call", call)
    for command in ("stop", "free"):
        args = build_parser().parse_args(["vm", command, "g1", "--grace", "2.5"])
        with pytest.raises(Called):
            args.handler(args)
    assert [request.timeout_ms for request in sent] == [2500, 2500]
    with pytest.raises(SystemExit):  # a uint32 of milliseconds at most, refused before any call
        build_parser().parse_args(["vm", "free", "g1", "--grace", "5000000"])
