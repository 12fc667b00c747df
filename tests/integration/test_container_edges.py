"""ContainerService at its edges, on this host with real runc: odd images, names, Exec requests,
mounts and resources, and Stop and Wait at awkward moments."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.bootargs import SHARE_MOUNT
from auraed.client import AuraeClient, ClientError
from auraed.containers.oci_cli import Runc
from auraed.containers.oci_spec import (
    ONLINE_CPUS,
    ONLINE_MEMORY_NODES,
    read_index_list,
)
from auraed.containers.request import (
    MAX_CFS_QUOTA_US,
    MAX_HOOK_TIMEOUT_SECONDS,
    PID_MAX_LIMIT,
)
from auraed.containers.runtime import OciRuntimeError
from auraed.system.cgroupfs import format_cpu_list
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.integration.containers_helpers import (
    BUSYBOX,
    CONTAINERS,
    create,
    delete,
    exec_in,
    import_layout,
    logs,
    refusal,
    run,
    start,
    status,
    stop,
    wait_exit,
    wait_for_line,
)
from tests.support.images import DEFAULT_ENV, BuiltImage, ImageConfig, build_busybox_layout

# busybox sh as PID 1 ignores SIGTERM unless it traps it: this one says so and goes on.
IGNORES_TERM = ["sh", "-c", "trap 'echo TERM' TERM; echo up; while true; do sleep 0.1; done"]


@pytest.fixture
async def loaded(daemon: DaemonProcess, busybox_layout: BuiltImage) -> AuraeClient:
    client = daemon.client()
    await import_layout(client, busybox_layout.layout, BUSYBOX)
    return client


def containers_left(daemon: DaemonProcess) -> list[Path]:
    return list((daemon.root / "state" / "containers").iterdir())


async def test_an_image_create_refuses_is_still_listed_and_described(
    loaded: AuraeClient, tmp_path: Path
) -> None:
    # The images subsystem stores a config with Env ["FOO"]; describing it once failed with
    # INTERNAL, and so did every ListImages after.
    odd = build_busybox_layout(tmp_path / "odd", ImageConfig(env=[*DEFAULT_ENV, "FOO"]))
    imported = await import_layout(loaded, odd.layout, "localhost/odd:1")
    assert imported.config is not None and imported.config.env == [*DEFAULT_ENV, "FOO"]
    listed = (await loaded.call(CONTAINERS, "ListImages", pb.ContainerServiceListImagesRequest())).images
    assert {r for i in listed for r in i.references} == {BUSYBOX, "localhost/odd:1"}
    request = pb.ContainerServiceImageStatusRequest(image="localhost/odd:1")
    described = (await loaded.call(CONTAINERS, "ImageStatus", request)).image
    assert described.config is not None and described.config.env == [*DEFAULT_ENV, "FOO"]
    refused = await refusal(create(loaded, "odd", "localhost/odd:1", command=["true"]))
    assert refused.code == "INVALID_ARGUMENT" and refused.message.startswith("image config.Env[1]: ")
    remove = pb.ContainerServiceRemoveImageRequest(image="localhost/odd:1")
    await loaded.call(CONTAINERS, "RemoveImage", remove)


async def test_a_shared_rootfs_whose_layers_are_not_there_is_refused_and_leaves_nothing(
    loaded: AuraeClient, daemon: DaemonProcess
) -> None:
    # A machine without its host's share mounted (this one): the container is not made.
    shared = pb.SharedRootfs(image_id="sha256:" + "ab" * 32, layers=[f"{SHARE_MOUNT}/no-such-key/0"])
    refused = await refusal(create(loaded, "unshared", "anything", command=["true"], shared_rootfs=shared))
    assert refused.code == "FAILED_PRECONDITION" and f"{SHARE_MOUNT}/no-such-key/0" in refused.message
    assert containers_left(daemon) == []
    listed = (await loaded.call(CONTAINERS, "List", pb.ContainerServiceListRequest())).containers
    assert [c.name for c in listed if c.name == "unshared"] == []


async def test_a_name_shaped_like_an_id_is_refused(loaded: AuraeClient, daemon: DaemonProcess) -> None:
    # Lookups try ids first: a container named after another's id once stood for that other one,
    # and Delete by its name deleted the other container.
    first = await create(loaded, "first", BUSYBOX, command=["true"])
    for name in (first.id, "a" * 32):
        refused = await refusal(create(loaded, name, BUSYBOX, command=["true"]))
        assert refused.code == "INVALID_ARGUMENT" and refused.message.startswith("config.name: "), refused
    assert (await status(loaded, first.id)).name == "first"
    await delete(loaded, first.id)
    assert containers_left(daemon) == []


async def test_exec_of_a_missing_program_is_not_a_missing_container(loaded: AuraeClient) -> None:
    # The runtime's "executable file not found in $PATH" once made NOT_FOUND, as if the
    # container were gone.
    await create(loaded, "box", BUSYBOX, command=["sleep", "300"])
    await start(loaded, "box")
    for command in (["nosuchcmd"], ["/bin/nosuch"]):
        refused = await refusal(exec_in(loaded, "box", command))
        assert refused.code == "FAILED_PRECONDITION" and command[0] in refused.message, refused
    assert (await status(loaded, "box")).state == pb.ContainerState.RUNNING
    await delete(loaded, "box")
    assert (await refusal(exec_in(loaded, "box", ["true"]))).code == "NOT_FOUND"


async def test_the_runtime_is_taken_at_its_own_word_for_a_missing_container(tmp_path: Path) -> None:
    # runc's state directory exists, its state does not: runc's exact words decide.
    runtime = Runc("runc", tmp_path)
    (tmp_path / "half").mkdir()
    with pytest.raises(OciRuntimeError) as gone:
        await runtime.kill("half", signal.SIGTERM)
    assert gone.value.kind == "not_found" and str(gone.value).endswith("container does not exist")
    # what runc 1.1 prints for Exec of a program the container lacks (logrus escapes the quotes)
    missing_program = (
        'level=error msg="exec failed: unable to start container process: '
        'exec: \\"x\\": executable file not found in $PATH"'
    )
    assert runtime.error("exec in half", "half", missing_program).kind == "failed"
    assert runtime.error("exec in none", "none", "anything at all").kind == "not_found"  # no state


async def test_exec_checks_its_fields_as_create_does(loaded: AuraeClient) -> None:
    await create(loaded, "box", BUSYBOX, command=["sleep", "300"], env=["A=1"])
    await start(loaded, "box")
    for command, fields, field in (
        (["true"], {"env": ["FOO"]}, "start.env[0]"),
        (["true"], {"env": ["OK=1", "A=\0"]}, "start.env[1]"),
        (["sh\0x"], {}, "start.command[0]"),
        ([""], {}, "start.command[0]"),
        (["true"], {"working_dir": "relative"}, "start.working_dir"),
        (["true"], {"working_dir": "/tmp/../etc"}, "start.working_dir"),
    ):
        refused = await refusal(exec_in(loaded, "box", command, **fields))
        assert refused.code == "INVALID_ARGUMENT" and refused.message.startswith(field + ": "), refused
    # The request's env overrides the container's by key, as Create's overrides the image's.
    out, _, code = await exec_in(
        loaded, "box", ["sh", "-c", 'echo "$A $B"; pwd'], env=["A=2", "B=3"], working_dir="/tmp"
    )
    assert (out, code) == (b"2 3\n/tmp\n", 0)
    await delete(loaded, "box")


async def test_a_mount_over_dev_or_sys_keeps_the_mounts_beneath_it(loaded: AuraeClient) -> None:
    # A tmpfs at /dev was mounted after /dev/pts, /dev/shm and /dev/mqueue and hid them: with a
    # terminal the container could not even start. A sysfs at /sys hid /sys/fs/cgroup.
    dev = pb.Mount(type="tmpfs", destination="/dev", options=["mode=755"])
    final = await run(
        loaded,
        "dev",
        BUSYBOX,
        command=["sh", "-c", "ls -d /dev/pts/ptmx /dev/shm /dev/mqueue && tty"],
        mounts=[dev],
        tty=True,
    )
    lines = await logs(loaded, "dev")
    assert final.exit_code == 0 and lines[-1].startswith("/dev/pts/"), lines
    sysfs = pb.Mount(type="sysfs", destination="/sys", options=["ro"])
    final = await run(
        loaded, "sys", BUSYBOX, command=["sh", "-c", 'test -n "$(ls /sys/fs/cgroup)"'], mounts=[sysfs]
    )
    assert final.exit_code == 0, await logs(loaded, "sys")
    for name in ("dev", "sys"):
        await delete(loaded, name)


async def test_absurd_resources_are_refused_at_create(loaded: AuraeClient, daemon: DaemonProcess) -> None:
    # They once passed Create and failed at Start with runc's cgroup error, leaving an EXITED
    # container behind.
    cpus = read_index_list(ONLINE_CPUS)
    nodes = read_index_list(ONLINE_MEMORY_NODES, missing=frozenset({0}))
    assert cpus and nodes
    hook = pb.Hook(path="/bin/true", timeout_seconds=MAX_HOOK_TIMEOUT_SECONDS + 1)
    for field, config in (
        ("resources.pids_max", {"resources": pb.Resources(pids_max=10**12)}),
        ("resources.pids_max", {"resources": pb.Resources(pids_max=PID_MAX_LIMIT + 1)}),
        ("resources.cpu_max", {"resources": pb.Resources(cpu_max=1 << 60)}),
        ("resources.cpuset_cpus", {"resources": pb.Resources(cpuset_cpus=f"0-{max(cpus) + 1}")}),
        ("resources.cpuset_mems", {"resources": pb.Resources(cpuset_mems=str(max(nodes) + 1))}),
        ("hooks.create_runtime[0].timeout_seconds", {"hooks": pb.Hooks(create_runtime=[hook])}),
    ):
        refused = await refusal(create(loaded, "absurd", BUSYBOX, command=["true"], **config))
        assert refused.code == "INVALID_ARGUMENT" and refused.message.startswith(field + ": "), refused
        assert containers_left(daemon) == []
    # The bounds are the kernel's own: a container at every one of them runs.
    at_limits = pb.Resources(
        pids_max=PID_MAX_LIMIT,
        cpu_max=MAX_CFS_QUOTA_US,
        cpuset_cpus=format_cpu_list(set(cpus)),
        cpuset_mems=format_cpu_list(set(nodes)),
    )
    final = await run(loaded, "limits", BUSYBOX, command=["true"], resources=at_limits)
    assert (final.state, final.exit_code) == (pb.ContainerState.EXITED, 0), final.reason
    await delete(loaded, "limits")


async def test_a_stop_whose_caller_gives_up_still_ends_with_sigkill(loaded: AuraeClient) -> None:
    # The stop signal, grace and SIGKILL once ran in the handler: a client whose deadline came
    # during the grace left a container that got only its stop signal, running for good.
    await create(loaded, "stubborn", BUSYBOX, command=IGNORES_TERM)
    await start(loaded, "stubborn")
    await wait_for_line(loaded, "stubborn", "up")
    refused = await refusal(stop(loaded, "stubborn", timeout_ms=3000, deadline=1))
    assert refused.code == "DEADLINE_EXCEEDED"
    final = await asyncio.wait_for(wait_exit(loaded, "stubborn"), 15)
    assert (final.state, final.signal) == (pb.ContainerState.EXITED, 9)
    assert "TERM" in await logs(loaded, "stubborn")
    await delete(loaded, "stubborn")

    # A second Stop joins the one under way, and its shorter timeout brings the SIGKILL forward.
    await create(loaded, "joined", BUSYBOX, command=IGNORES_TERM)
    await start(loaded, "joined")
    await wait_for_line(loaded, "joined", "up")
    patient = asyncio.ensure_future(stop(loaded, "joined", timeout_ms=60_000))
    await wait_for_line(loaded, "joined", "TERM")
    hurried = await asyncio.wait_for(stop(loaded, "joined", timeout_ms=0), 15)
    assert (hurried.state, hurried.signal) == (pb.ContainerState.EXITED, 9)
    assert (await asyncio.wait_for(patient, 5)).signal == 9
    assert (await logs(loaded, "joined")).count("TERM") == 1  # one stop signal, not two
    await delete(loaded, "joined")


async def test_a_delete_whose_caller_gives_up_still_removes_everything(
    loaded: AuraeClient, daemon: DaemonProcess
) -> None:
    # A Delete cut short (aer container run --rm interrupted, a deadline) once left the container
    # half removed and still listed: its runtime delete killed mid-way, its files kept.
    before = containers_left(daemon)
    # The runtime's delete runs poststop hooks: this one holds it for a second.
    hooks = pb.Hooks(poststop=[pb.Hook(path="/bin/sh", args=["-c", "sleep 1"])])
    await create(loaded, "doomed", BUSYBOX, command=IGNORES_TERM, hooks=hooks)
    await start(loaded, "doomed")
    await wait_for_line(loaded, "doomed", "up")
    request = pb.ContainerServiceDeleteRequest(container_id="doomed", force=True)
    refused = await refusal(loaded.call(CONTAINERS, "Delete", request, timeout=0.5))
    assert refused.code == "DEADLINE_EXCEEDED"

    async def none_listed() -> bool:
        return not (await loaded.call(CONTAINERS, "List", pb.ContainerServiceListRequest())).containers

    await wait_until(none_listed, timeout=15)
    assert containers_left(daemon) == before


async def test_an_exited_container_is_deleted_in_the_runtime_at_once(
    loaded: AuraeClient, daemon: DaemonProcess, tmp_path: Path
) -> None:
    # As containerd deletes a task when it exits: the runtime's delete (its state, its cgroup,
    # the poststop hooks) runs at the exit, not at the Remove, which then has only files left.
    marker = tmp_path / "poststop-ran"
    hooks = pb.Hooks(poststop=[pb.Hook(path="/bin/sh", args=["-c", f"echo ran > {marker}"])])
    await create(loaded, "brief", BUSYBOX, command=["sh", "-c", "exit 3"], hooks=hooks)
    await start(loaded, "brief")
    ended = await asyncio.wait_for(wait_exit(loaded, "brief"), 15)
    runtime = Runc("runc", daemon.root / "run" / "runtime")

    def released() -> bool:
        return marker.exists() and not runtime.knows(ended.id)

    await wait_until(released, timeout=10)
    described = await status(loaded, "brief")
    assert (described.state, described.exit_code) == (pb.ContainerState.EXITED, 3)
    before = containers_left(daemon)
    await delete(loaded, "brief", force=False)
    assert len(containers_left(daemon)) == len(before) - 1
    assert marker.read_text() == "ran\n"  # once: the Remove did not run the hooks again


async def test_a_stop_under_way_when_auraed_stops_is_finished(
    daemon_factory: DaemonFactory, busybox_layout: BuiltImage
) -> None:
    # Containers outlive auraed (stop_containers_on_shutdown is off), but one a client asked to
    # stop is not left with only its stop signal: its SIGKILL goes as auraed shuts down.
    daemon = daemon_factory()
    async with daemon.client() as client:
        await import_layout(client, busybox_layout.layout, BUSYBOX)
        await create(client, "stopping", BUSYBOX, command=IGNORES_TERM)
        await start(client, "stopping")
        await create(client, "staying", BUSYBOX, command=["sleep", "300"])
        await start(client, "staying")
        await wait_for_line(client, "stopping", "up")
        stopping_pid = (await status(client, "stopping")).pid
        staying_pid = (await status(client, "staying")).pid
        patient = asyncio.ensure_future(stop(client, "stopping", timeout_ms=60_000))
        await wait_for_line(client, "stopping", "TERM")
        assert await asyncio.to_thread(daemon.stop) == 0
        assert (await patient).signal == 9  # answered before the server went
    assert not Path(f"/proc/{stopping_pid}").exists()
    assert Path(f"/proc/{staying_pid}").exists()
    assert "was never retrieved" not in daemon.log() and "destroyed but it is pending" not in daemon.log()
    daemon.start()
    async with daemon.client() as client:
        assert (await status(client, "stopping")).signal == 9
        for name in ("stopping", "staying"):
            await delete(client, name)


async def test_wait_on_a_container_being_created_waits_for_its_end(
    loaded: AuraeClient, tmp_path: Path
) -> None:
    # A Wait on a container still being created (Create with start, under way) once returned at
    # once with state CREATED. The hook keeps the container in the making until the test has seen
    # it CREATED (or 30 s).
    async def create_started(name: str, command: list[str], then: str = "true") -> pb.ContainerStatus:
        go = tmp_path / f"{name}.go"
        hook = f"i=0; while [ ! -e {go} ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; {then}"
        hooks = pb.Hooks(create_runtime=[pb.Hook(path="/bin/sh", args=["-c", hook])])
        config = pb.ContainerConfig(name=name, image=BUSYBOX, command=command, hooks=hooks)
        request = pb.ContainerServiceCreateRequest(config=config, start=True)
        return (await loaded.call(CONTAINERS, "Create", request, timeout=60)).status

    async def wait_while_created(name: str) -> pb.ContainerStatus:
        async def being_created() -> bool:  # Create has saved the record (CREATING: "created")
            with contextlib.suppress(ClientError):
                return (await status(loaded, name)).state == pb.ContainerState.CREATED
            return False

        await wait_until(being_created, 20, interval=0.01)
        waiting = asyncio.ensure_future(wait_exit(loaded, name))
        # The Wait is in before the hook lets Create go on: a call behind it on the same channel
        # has had its answer (calls are served in the order they come).
        await asyncio.sleep(0.2)
        await status(loaded, name)
        (tmp_path / f"{name}.go").touch()
        return await waiting

    creating = asyncio.ensure_future(create_started("slow", ["sh", "-c", "exit 3"]))
    final = await asyncio.wait_for(wait_while_created("slow"), 30)
    assert (final.state, final.exit_code) == (pb.ContainerState.EXITED, 3)
    await creating
    await delete(loaded, "slow")

    # One whose Create fails (its hook) is removed before it ran: its Wait says so.
    failing = asyncio.ensure_future(create_started("broken", ["true"], then="exit 1"))
    refused = await refusal(asyncio.wait_for(wait_while_created("broken"), 30))
    assert (refused.code, refused.message) == ("NOT_FOUND", "container broken was removed before it ran")
    assert (await refusal(failing)).code == "FAILED_PRECONDITION"


async def test_a_long_log_comes_in_few_messages(loaded: AuraeClient) -> None:
    # One message a line made 200 000 lines take ~10 s to read; grpc's cost is per message.
    await create(loaded, "chatty", BUSYBOX, command=["sh", "-c", "seq 20000; echo done >&2"])
    await start(loaded, "chatty")
    assert (await wait_exit(loaded, "chatty")).exit_code == 0

    async def replies(**fields: Any) -> list[pb.ContainerServiceLogsResponse]:
        request = pb.ContainerServiceLogsRequest(container_id="chatty", **fields)
        return [reply async for reply in loaded.stream(CONTAINERS, "Logs", request, timeout=60)]

    everything = await replies()
    assert len(everything) <= 3
    lines = [(line.stream, line.line) for reply in everything for line in reply.lines]
    # Where "done" falls among the last stdout lines depends on the order the monitor read the
    # two pipes in; each stream's own order is fixed.
    assert [text for stream, text in lines if stream == "stdout"] == [str(n) for n in range(1, 20001)]
    assert [text for stream, text in lines if stream == "stderr"] == ["done"]
    tail = await replies(tail=3, stream="stdout")
    assert [line.line for reply in tail for line in reply.lines] == ["19998", "19999", "20000"]
    await delete(loaded, "chatty")
