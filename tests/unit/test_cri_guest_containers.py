"""What the host keeps of a vm pod's containers, without a guest: the copy of a guest's log into
the kubelet's log path (record by record, resumed with nothing lost or twice), the config a guest
is given, and the mirror of a guest's status."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from auraed.api.aurae.containers import v0 as pb
from auraed.containers.model import ContainerRecord, State
from auraed.containers.request import ContainerRequest, Mount, Resources, Security
from auraed.containers.sandbox import SandboxContext
from auraed.cri.guest_containers import (
    GuestContainers,
    _Guested,
    _remove_directory,
    _Resume,
    config_message,
    mirror,
    pod_file_mounts,
)
from tests.integration.test_cri_containers import stdout_lines


def guested(tmp_path: Path) -> _Guested:
    record = ContainerRecord(
        id="c1", name="web_p_n_u_0", image="busybox", image_id="sha256:1", directory=str(tmp_path / "c1"),
        labels={}, tty=False, stop_signal=0, process={}, log_file=str(tmp_path / "logs" / "web.log"),
    )  # fmt: skip
    return _Guested("pod-1", record)


def lines(*entries: tuple[float, str]) -> list[pb.LogLine]:
    return [pb.LogLine(line=text, stream="stdout", timestamp=ts) for ts, text in entries]


def write(keeper: _Guested, batch: list[pb.LogLine]) -> None:
    # _write_lines touches no state of the host but the record's log, the store (absent here) and
    # the containers whose log path it found no regular file.
    host = GuestContainers.__new__(GuestContainers)
    host._containers = {}
    host._logs_refused = set()
    host._write_lines(keeper, batch, _Resume(keeper.log_us, keeper.log_seen))


def test_a_resumed_copy_skips_exactly_what_was_written(tmp_path: Path) -> None:
    keeper = guested(tmp_path)
    write(keeper, lines((100.000001, "a"), (100.000002, "b"), (100.000002, "c")))
    assert (keeper.log_us, keeper.log_seen) == (100_000_002, 2)
    # The guest sends again from that microsecond on: b and c were copied, d was not.
    write(keeper, lines((100.000002, "b"), (100.000002, "c"), (100.000002, "d"), (100.5, "e")))
    assert stdout_lines(Path(keeper.record.log_file)) == ["a", "b", "c", "d", "e"]
    assert (keeper.log_us, keeper.log_seen) == (100_500_000, 1)


def test_the_host_log_keeps_the_cri_format(tmp_path: Path) -> None:
    keeper = guested(tmp_path)
    write(keeper, [pb.LogLine(line="oops", stream="stderr", timestamp=1764633600.5)])
    assert Path(keeper.record.log_file).read_text() == "2025-12-02T00:00:00.500000000Z stderr F oops\n"


def test_a_host_log_swapped_for_a_fifo_drops_lines_and_waits_for_no_reader(tmp_path: Path) -> None:
    keeper = guested(tmp_path)
    log = Path(keeper.record.log_file)
    log.parent.mkdir()
    os.mkfifo(log)
    began = time.monotonic()
    write(keeper, lines((100.0, "lost")))
    assert time.monotonic() - began < 1  # dropped, as a monitor drops what its log cannot take
    log.unlink()  # a regular file again: the copy goes on with the lines that come
    write(keeper, lines((100.0, "lost"), (101.0, "kept")))
    assert stdout_lines(log) == ["kept"]


def test_a_partial_record_is_copied_as_one(tmp_path: Path) -> None:
    """The guest sends its log by records (partial): a line's parts reach the host's log as P
    records as soon as they come, the line ended by its F, as the guest logged them."""
    keeper = guested(tmp_path)
    write(keeper, [pb.LogLine(line="hello", stream="stdout", timestamp=1764633600.5, partial=True)])
    write(keeper, [pb.LogLine(line=" world", stream="stdout", timestamp=1764633601.0)])
    assert Path(keeper.record.log_file).read_text() == (
        "2025-12-02T00:00:00.500000000Z stdout P hello\n2025-12-02T00:00:01.000000000Z stdout F  world\n"
    )
    assert stdout_lines(Path(keeper.record.log_file)) == ["hello world"]


def test_a_guest_is_given_the_whole_security_context() -> None:
    base = ContainerRequest(name="web_p_n_u_1")
    section = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}],
    }
    exact = Security(privileged=True, seccomp=section, exact_paths=True, masked_paths=())
    given = config_message(ContainerRequest(name="w_p", security=exact), "busybox", {}, share_pid=False)
    assert given.security is not None
    assert (given.security.privileged, given.security.exact_paths) == (True, True)
    assert json.loads(given.security.seccomp_json) == section
    plain = config_message(base, "busybox", {}, share_pid=False).security
    assert plain is not None and (plain.privileged, plain.seccomp_json, plain.exact_paths) == (
        False,
        "",
        False,
    )
    config = config_message(base, "busybox", {"a": "b"}, share_pid=True)
    attachable = config_message(
        ContainerRequest(name="w_p", stdin=True, stdin_once=True), "busybox", {}, False
    )
    assert (attachable.stdin, attachable.stdin_once) == (True, True)
    # What a kubelet sends for every container, cgroup v2 node or not: the guest's runtime makes
    # cpu.weight of it.
    limited = ContainerRequest(
        name="w_p", resources=Resources(cpu_shares=2, memory_max=1 << 26, memory_swap=-1)
    )
    resources = config_message(limited, "busybox", {}, False).resources
    assert resources is not None and (resources.cpu_shares, resources.memory_swap) == (2, -1)
    assert (config.name, config.host_network, config.host_ipc, config.shared_pid) == (
        "web-1",
        True,
        True,
        "pod",
    )
    mounted = ContainerRequest(
        name="w_p", mounts=(Mount("/data", "/run/aurae/share/k/0", "bind", ("rprivate",)),)
    )
    assert [m.source for m in config_message(mounted, "busybox", {}, share_pid=False).mounts] == [
        "/run/aurae/share/k/0"
    ]


def test_the_mirror_follows_the_guests_status(tmp_path: Path) -> None:
    record = guested(tmp_path).record
    mirror(
        record,
        pb.ContainerStatus(id="c1", state=pb.ContainerState.EXITED, exit_code=3, pid=0, reason="Error"),
    )
    assert (record.state, record.exit_code, record.reason) == (State.EXITED, 3, "Error")


def test_the_pods_etc_files_are_mounted_unless_the_request_mounts_its_own(tmp_path: Path) -> None:
    sandbox = SandboxContext(
        sandbox_id="pod",
        resolv_conf=tmp_path / "resolv.conf",
        hosts=tmp_path / "hosts",
        hostname_file=tmp_path / "hostname",
    )
    own = Mount(destination="/etc/hosts", source="/srv/hosts")
    read_only = Security(read_only_rootfs=True)
    request = ContainerRequest(name="web", mounts=(own,), security=read_only)
    mounts = pod_file_mounts(request, sandbox)
    assert [(m.destination, m.source) for m in mounts] == [
        ("/etc/resolv.conf", str(tmp_path / "resolv.conf")),
        ("/etc/hostname", str(tmp_path / "hostname")),
    ]
    assert all(m.read_only and m.type == "bind" for m in mounts)  # a read-only rootfs: read-only
    assert pod_file_mounts(ContainerRequest(name="web"), SandboxContext()) == ()


def test_a_removed_containers_directory_goes_with_its_own_log_unless_kept(tmp_path: Path) -> None:
    for keep in (False, True):
        directory = tmp_path / f"c-{keep}"
        directory.mkdir()
        log = directory / "container.log"  # where the log is when the pod names no log directory
        log.write_text("line\n")
        (directory / "doc.json").write_text("{}")
        _remove_directory(directory, log if keep else None)
        assert directory.exists() is keep and log.exists() is keep
