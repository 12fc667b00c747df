"""The host placing containers in a guest: image blobs sent over ImportImage, calls relayed.

The "guest" here is a second real auraed (the same ContainerService every guest serves, reached
over mTLS); the host side runs in-process with its own image store. Booting the guest as a VM is
tested with the VM service; this proves the placement protocol on its own.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, ClientError, log_lines
from auraed.containers.containers import Containers
from auraed.containers.files import CopiedFiles
from auraed.containers.servicer import SERVICE_NAME, ContainerServicer
from auraed.errors import AuraeError
from auraed.images.content import LocalStore
from auraed.images.images import Images
from auraed.server.guest_router import GuestRouter
from auraed.server.rpc import generic_handler
from auraed.state.store import Store
from auraed.vms.placement import GuestEndpoint, ImagePlacer, send_image
from auraed.wire.metadata import VM_METADATA_KEY
from tests.conftest import DaemonProcess
from tests.support.images import BuiltImage

IMAGE = "localhost/busybox:1"


class Boots:
    """The fake guest's boot time: a test "reboots" it by moving it."""

    booted_at = 1.0


@pytest.fixture
def boots() -> Boots:
    return Boots()


@pytest.fixture
async def host(
    tmp_path: Path, busybox_layout: BuiltImage, daemon: DaemonProcess, boots: Boots
) -> AsyncIterator[tuple[AuraeClient, Images]]:
    store = Store(tmp_path / "host.db")
    local = LocalStore(tmp_path / "images")
    images = Images(store, local, local, registry_factory=lambda: None)  # type: ignore[arg-type,return-value]
    await images.import_layout(busybox_layout.layout, "latest", IMAGE)
    guest = daemon.client()

    async def lookup(name: str) -> GuestEndpoint:
        if name != "g1":
            raise AuraeError.not_found(f"vm {name}")
        return GuestEndpoint(
            name, str(daemon.socket), "server.unsafe.aurae.io", guest.channel, boots.booted_at
        )

    server = grpc.aio.server()
    # Every call to the host names a VM, so the local servicer is never reached.
    local = generic_handler(
        SERVICE_NAME, ContainerServicer(images, cast(Containers, None), cast(CopiedFiles, None))
    )
    server.add_generic_rpc_handlers([GuestRouter(lookup, ImagePlacer(images), [local])])
    socket = Path(tempfile.mkdtemp(prefix="aurae-host-", dir="/tmp")) / "host.sock"
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix:{socket}")
    client = AuraeClient(channel)
    try:
        yield client, images
    finally:
        await channel.close()
        await server.stop(0)
        await guest.close()
        store.close()
        socket.unlink(missing_ok=True)
        socket.parent.rmdir()


def on_vm(name: str = "g1") -> Any:
    return (("aurae-vm", name),)


async def call(client: AuraeClient, method: str, request: Any, vm: str = "g1") -> Any:
    response = client._response_class("aurae.containers.v0.ContainerService", method)
    callable_ = client.channel.unary_unary(
        f"/{SERVICE_NAME}/{method}", request_serializer=bytes, response_deserializer=response.parse
    )
    try:
        return await callable_(request, metadata=((VM_METADATA_KEY, vm),), timeout=60)
    except grpc.aio.AioRpcError as exc:
        raise ClientError(exc.code().name, exc.details() or "") from None


async def test_create_in_guest_sends_missing_blobs_then_runs(
    host: tuple[AuraeClient, Images], daemon: DaemonProcess, busybox_layout: BuiltImage
) -> None:
    client, images = host
    config = pb.ContainerConfig(
        name="placed", image=IMAGE, command=["sh", "-c", "echo from the guest; hostname"]
    )
    created = await call(client, "Create", pb.ContainerServiceCreateRequest(config=config))
    assert created.status.state == pb.ContainerState.CREATED
    await call(client, "Start", pb.ContainerServiceStartRequest(container_id="placed"))
    final = await call(client, "Wait", pb.ContainerServiceWaitRequest(container_id="placed"))
    assert final.status.exit_code == 0
    # Server streaming relayed: the guest's logs through the host.
    logs = client.channel.unary_stream(
        f"/{SERVICE_NAME}/Logs",
        request_serializer=bytes,
        response_deserializer=pb.ContainerServiceLogsResponse.parse,
    )
    lines = [
        line.line
        async for reply in logs(
            pb.ContainerServiceLogsRequest(container_id="placed"), metadata=on_vm(), timeout=30
        )
        for line in log_lines(reply)
    ]
    assert lines[0] == "from the guest"
    # The guest holds the image now, and a second placement sends nothing.
    async with daemon.client() as guest:
        image = (
            await guest.call(SERVICE_NAME, "ImageStatus", pb.ContainerServiceImageStatusRequest(image=IMAGE))
        ).image
        assert image.id == busybox_layout.config_digest
        assert await send_image(guest.channel, images.find(IMAGE), images.content, IMAGE) == 0
    await call(client, "Delete", pb.ContainerServiceDeleteRequest(container_id="placed", force=True))


async def test_an_image_is_placed_once_and_again_when_the_guest_lost_it(
    host: tuple[AuraeClient, Images], daemon: DaemonProcess, boots: Boots, caplog: pytest.LogCaptureFixture
) -> None:
    client, _ = host
    caplog.set_level("INFO", logger="auraed.vms.placement")

    def placements() -> int:
        return sum("placed in guest g1" in r.getMessage() for r in caplog.records)

    async def create_and_delete(name: str) -> None:
        config = pb.ContainerConfig(name=name, image=IMAGE, command=["true"])
        await call(client, "Create", pb.ContainerServiceCreateRequest(config=config))
        await call(client, "Delete", pb.ContainerServiceDeleteRequest(container_id=name, force=True))

    await create_and_delete("first")
    assert placements() == 1
    await create_and_delete("second")  # straight through: no MissingBlobs/ImportImage round trips
    assert placements() == 1
    # Removed in the guest behind the host's back: the Create finds it missing and places it again.
    async with daemon.client() as guest:
        await guest.call(SERVICE_NAME, "RemoveImage", pb.ContainerServiceRemoveImageRequest(image=IMAGE))
    await create_and_delete("third")
    assert placements() == 2
    # Removed through the host: the host forgets it placed it.
    await call(client, "RemoveImage", pb.ContainerServiceRemoveImageRequest(image=IMAGE))
    await create_and_delete("fourth")
    assert placements() == 3
    # A new boot of the VM starts with an empty store: placed again before the first Create,
    # here even though this "guest" kept the image.
    boots.booted_at += 1
    await create_and_delete("fifth")
    assert placements() == 4
    await create_and_delete("sixth")
    assert placements() == 4


async def test_exec_is_relayed_both_ways(host: tuple[AuraeClient, Images]) -> None:
    client, _ = host
    config = pb.ContainerConfig(name="box", image=IMAGE, command=["sleep", "300"])
    await call(client, "Create", pb.ContainerServiceCreateRequest(config=config))
    await call(client, "Start", pb.ContainerServiceStartRequest(container_id="box"))

    async def requests() -> AsyncIterator[pb.ContainerServiceExecRequest]:
        yield pb.ContainerServiceExecRequest(
            start=pb.ExecStart(container_id="box", command=["cat"], stdin=True)
        )
        yield pb.ContainerServiceExecRequest(stdin=b"round trip\n")
        yield pb.ContainerServiceExecRequest(close_stdin=True)

    exec_call = client.channel.stream_stream(
        f"/{SERVICE_NAME}/Exec",
        request_serializer=bytes,
        response_deserializer=pb.ContainerServiceExecResponse.parse,
    )
    out, code = b"", None
    async for reply in exec_call(requests(), metadata=on_vm(), timeout=30):
        out += reply.stdout
        code = reply.exit_code if reply.exit_code is not None else code
    assert (out, code) == (b"round trip\n", 0)
    await call(client, "Delete", pb.ContainerServiceDeleteRequest(container_id="box", force=True))


async def test_unknown_vm_and_unknown_image(host: tuple[AuraeClient, Images]) -> None:
    client, _ = host
    with pytest.raises(ClientError) as error:
        await call(client, "List", pb.ContainerServiceListRequest(), vm="nope")
    assert error.value.code == "NOT_FOUND" and "nope" in error.value.message
    config = pb.ContainerConfig(name="x", image="localhost/absent:1", command=["true"])
    with pytest.raises(ClientError) as error:
        await call(client, "Create", pb.ContainerServiceCreateRequest(config=config))
    assert error.value.code == "NOT_FOUND" and "absent" in error.value.message


async def test_a_malformed_create_is_refused_by_the_host(host: tuple[AuraeClient, Images]) -> None:
    client, _ = host
    create = client.channel.unary_unary(f"/{SERVICE_NAME}/Create")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await create(b"\x0a\x05ab", metadata=on_vm(), timeout=30)  # config cut short
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed ContainerServiceCreateRequest" in (error.value.details() or "")
