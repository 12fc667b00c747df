"""The daemon on a full disk: its state dir on a small tmpfs.

Whatever runs out (an image's blobs and snapshots, the SQLite store), the client is told
RESOURCE_EXHAUSTED and why, the daemon keeps serving, and nothing half-made stays behind: once
there is room again the same request succeeds.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Awaitable, Iterator
from pathlib import Path

import pytest

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, ClientError
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.containers_helpers import CONTAINERS, create, delete, import_layout
from tests.support.images import BuiltImage, push_layout
from tests.support.registry import LocalRegistry

STATE_SIZE = "12m"  # room for the busybox image, not for the ~50 MB one
CELLS = "aurae.cells.v0.CellService"


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "small-state"
    state.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={STATE_SIZE},mode=0700", "tmpfs", str(state)], check=True
    )
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


@pytest.fixture
def daemon(daemon_factory: DaemonFactory, small_state: Path) -> Iterator[DaemonProcess]:
    daemon = daemon_factory("--state-dir", str(small_state))
    yield daemon
    daemon.stop()  # before the tmpfs goes


async def exhausted(call: Awaitable[object]) -> str:
    with pytest.raises(ClientError) as error:
        await call
    assert error.value.code == "RESOURCE_EXHAUSTED", error.value
    return error.value.message


def assert_only_whole_blobs(state: Path) -> None:
    assert list((state / "images" / "ingest").iterdir()) == []
    for blob in (state / "images" / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name


async def list_images(client: AuraeClient) -> list[pb.Image]:
    return (await client.call(CONTAINERS, "ListImages", pb.ContainerServiceListImagesRequest())).images


async def test_an_image_too_big_for_the_disk(
    daemon: DaemonProcess, small_state: Path, large_layout: BuiltImage
) -> None:
    with LocalRegistry() as registry:
        push_layout(large_layout, f"{registry.host}/big:1")
        async with daemon.client() as client:
            pull = pb.ContainerServicePullImageRequest(reference=f"{registry.host}/big:1")

            async def pull_all() -> None:
                async for _ in client.stream(CONTAINERS, "PullImage", pull, timeout=120):
                    pass

            assert "No space left on device" in await exhausted(pull_all())
            # Every layer has stopped and cleaned up by the time the error is reported.
            assert_only_whole_blobs(small_state)
            await exhausted(import_layout(client, large_layout.layout, "localhost/big:1"))
            assert await list_images(client) == []
            assert await client.health() == "SERVING"
    assert_only_whole_blobs(small_state)
    assert "RESOURCE_EXHAUSTED" in daemon.log() and "Traceback" not in daemon.log()


async def test_a_full_state_store_refuses_new_records_and_keeps_none(
    daemon: DaemonProcess, small_state: Path, busybox_layout: BuiltImage
) -> None:
    async with daemon.client() as client:
        await import_layout(client, busybox_layout.layout, "localhost/busybox:1")
        filler = small_state / "filler"
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=64"], capture_output=True, check=False
        )
        allocate = cells_pb.CellServiceAllocateRequest(cell=cells_pb.Cell(name="full"))
        await exhausted(client.call(CELLS, "Allocate", allocate))
        await exhausted(create(client, "full", "localhost/busybox:1", command=["true"]))
        assert (await client.call(CELLS, "List", cells_pb.CellServiceListRequest())).cells == []
        listed = await client.call(CONTAINERS, "List", pb.ContainerServiceListRequest())
        assert listed.containers == []
        # Room again: the same names are free, nothing claims them.
        filler.unlink()
        assert (await create(client, "full", "localhost/busybox:1", command=["true"])).name == "full"
        await client.call(CELLS, "Allocate", allocate)
        await delete(client, "full")
        await client.call(CELLS, "Free", cells_pb.CellServiceFreeRequest(cell_name="full"))
