"""Helpers shared by the container tests: calls to ContainerService and the test images."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, ClientError, log_lines
from tests.conftest import wait_until

CONTAINERS = "aurae.containers.v0.ContainerService"
BUSYBOX = "localhost/busybox:latest"


async def refusal(call: Awaitable[object]) -> ClientError:
    """The error of a call that must fail."""
    with pytest.raises(ClientError) as error:
        await call
    return error.value


async def import_layout(
    client: AuraeClient, layout: Path, reference: str, ref_name: str = "latest"
) -> pb.Image:
    request = pb.ContainerServiceImportImageLayoutRequest(
        path=str(layout), ref_name=ref_name, reference=reference
    )
    reply = await client.call(CONTAINERS, "ImportImageLayout", request)
    return reply.image


async def create(client: AuraeClient, name: str, image: str, **config: Any) -> pb.ContainerStatus:
    request = pb.ContainerServiceCreateRequest(config=pb.ContainerConfig(name=name, image=image, **config))
    return (await client.call(CONTAINERS, "Create", request)).status


async def start(client: AuraeClient, container: str) -> pb.ContainerStatus:
    return (
        await client.call(CONTAINERS, "Start", pb.ContainerServiceStartRequest(container_id=container))
    ).status


async def run(client: AuraeClient, name: str, image: str, **config: Any) -> pb.ContainerStatus:
    """Create, start and wait for the end of a container."""
    await create(client, name, image, **config)
    await start(client, name)
    return await wait_exit(client, name)


async def wait_exit(client: AuraeClient, container: str) -> pb.ContainerStatus:
    """The container's status once it has ended."""
    request = pb.ContainerServiceWaitRequest(container_id=container)
    return (await client.call(CONTAINERS, "Wait", request, timeout=60)).status


async def status(client: AuraeClient, container: str) -> pb.ContainerStatus:
    return (
        await client.call(CONTAINERS, "Status", pb.ContainerServiceStatusRequest(container_id=container))
    ).status


async def logs(client: AuraeClient, container: str, follow: bool = False, **fields: Any) -> list[str]:
    request = pb.ContainerServiceLogsRequest(container_id=container, follow=follow, **fields)
    replies = client.stream(CONTAINERS, "Logs", request, timeout=60)
    return [line.line async for reply in replies for line in log_lines(reply)]


async def wait_running(client: AuraeClient, container: str) -> None:
    async def running() -> bool:
        return (await status(client, container)).state == pb.ContainerState.RUNNING

    await wait_until(running, 20)


async def wait_for_line(client: AuraeClient, container: str, text: str) -> None:
    async def seen() -> bool:
        return any(text in line for line in await logs(client, container))

    await wait_until(seen, 20)


async def stop(
    client: AuraeClient, container: str, timeout_ms: int | None = None, *, deadline: float | None = None
) -> pb.ContainerStatus:
    """Stop with ``timeout_ms`` of grace (the daemon's default when None), the client giving up
    after ``deadline`` seconds."""
    request = pb.ContainerServiceStopRequest(container_id=container, timeout_ms=timeout_ms)
    return (await client.call(CONTAINERS, "Stop", request, timeout=deadline)).status


async def delete(client: AuraeClient, container: str, force: bool = True) -> None:
    await client.call(
        CONTAINERS, "Delete", pb.ContainerServiceDeleteRequest(container_id=container, force=force)
    )


async def exec_in(
    client: AuraeClient,
    container: str,
    command: list[str],
    stdin: bytes = b"",
    *,
    tty: bool = False,
    size: tuple[int, int] | None = None,
    **start: Any,
) -> tuple[bytes, bytes, int]:
    """Run a command in a container through the Exec stream: stdout, stderr and exit code.
    ``start``: more ExecStart fields (env, working_dir, user)."""
    start_message = pb.ExecStart(container_id=container, command=command, tty=tty, stdin=bool(stdin), **start)
    if size:
        start_message.size = pb.TerminalSize(rows=size[0], columns=size[1])
    messages = [pb.ContainerServiceExecRequest(start=start_message)]
    if stdin:
        messages += [
            pb.ContainerServiceExecRequest(stdin=stdin),
            pb.ContainerServiceExecRequest(close_stdin=True),
        ]

    async def requests() -> AsyncIterator[pb.ContainerServiceExecRequest]:
        for message in messages:
            yield message

    out, err, code = b"", b"", -1
    async for reply in client.duplex(CONTAINERS, "Exec", requests(), timeout=60):
        out += reply.stdout
        err += reply.stderr
        if reply.exit_code is not None:
            code = reply.exit_code
    return out, err, code
