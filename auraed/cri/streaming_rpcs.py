"""Exec, Attach and PortForward: each validates its request, checks that what it names can be
streamed now, and answers with a URL of auraed's streaming server (auraed.cri.streaming), where
the client then speaks SPDY/3.1 or WebSocket. The session itself starts when the client dials.
"""

from __future__ import annotations

import dataclasses

from auraed.api.runtime import v1 as cri
from auraed.cri.errors import CriError
from auraed.cri.model import PodState, plausible_id
from auraed.cri.pods import Pods
from auraed.cri.sessions import CriSessions
from auraed.cri.streaming.backend import AttachRequest, ExecRequest, PortForwardRequest
from auraed.cri.streaming.server import StreamingServer
from auraed.wire.handlers import Context

MAX_ARGS = 4096
"""Most words in an exec's command."""
MAX_ARG_BYTES = 128 * 1024
"""Longest word of an exec's command (the kernel's MAX_ARG_STRLEN)."""
MAX_PORTS = 1024
"""Most ports one PortForward may name."""


def _command(words: list[str]) -> tuple[str, ...]:
    if not words:
        raise CriError.invalid("cmd", "must name a command")
    if len(words) > MAX_ARGS:
        raise CriError.invalid("cmd", f"has {len(words)} words; at most {MAX_ARGS}")
    for index, word in enumerate(words):
        if "\0" in word:
            raise CriError.invalid(f"cmd[{index}]", "contains a NUL character")
        if len(word.encode()) > MAX_ARG_BYTES:
            raise CriError.invalid(f"cmd[{index}]", f"is longer than {MAX_ARG_BYTES} bytes")
    if not words[0]:
        raise CriError.invalid("cmd[0]", "must not be empty")
    return tuple(words)


def _streams(stdin: bool, stdout: bool, stderr: bool, tty: bool) -> None:
    """The kubelet's own rules for a remote command's streams."""
    if not (stdin or stdout or stderr):
        raise CriError.invalid("stdin", "one of stdin, stdout or stderr must be true")
    if tty and stderr:
        raise CriError.invalid("stderr", "tty and stderr cannot both be true: a terminal has one output")


def _ports(ports: list[int]) -> tuple[int, ...]:
    if len(ports) > MAX_PORTS:
        raise CriError.invalid("port", f"names {len(ports)} ports; at most {MAX_PORTS}")
    for port in ports:
        if not 0 < port <= 65535:
            raise CriError.invalid("port", f"{port} is not a TCP port (1 to 65535)")
    return tuple(ports)


class StreamingRpcs:
    """The streaming RPCs of runtime.v1.RuntimeService."""

    def __init__(self, server: StreamingServer, sessions: CriSessions, pods: Pods) -> None:
        self._server = server
        self._sessions = sessions
        self._pods = pods

    async def exec(self, request: cri.ExecRequest, context: Context) -> cri.ExecResponse:
        container_id = plausible_id(request.container_id, "container_id")
        cmd = _command(list(request.cmd))
        _streams(request.stdin, request.stdout, request.stderr, request.tty)
        wanted = ExecRequest(
            container_id=self._sessions.exec_target(container_id),
            cmd=cmd,
            tty=request.tty,
            stdin=request.stdin,
            stdout=request.stdout,
            stderr=request.stderr,
        )
        return cri.ExecResponse(url=self._server.url_for(wanted))

    async def attach(self, request: cri.AttachRequest, context: Context) -> cri.AttachResponse:
        container_id = plausible_id(request.container_id, "container_id")
        _streams(request.stdin, request.stdout, request.stderr, request.tty)
        wanted = AttachRequest(
            container_id=container_id,
            tty=request.tty,
            stdin=request.stdin,
            stdout=request.stdout,
            stderr=request.stderr,
        )
        container = self._sessions.attachable(wanted)
        wanted = dataclasses.replace(wanted, container_id=container.record.id)  # not a prefix of it
        return cri.AttachResponse(url=self._server.url_for(wanted))

    async def port_forward(
        self, request: cri.PortForwardRequest, context: Context
    ) -> cri.PortForwardResponse:
        pod_id = plausible_id(request.pod_sandbox_id, "pod_sandbox_id")
        ports = _ports(list(request.port))
        pod = self._pods.get(pod_id)
        if pod.state != PodState.READY:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} is not ready: nothing to forward to")
        wanted = PortForwardRequest(pod_sandbox_id=pod.id, ports=ports)
        return cri.PortForwardResponse(url=self._server.url_for(wanted))
