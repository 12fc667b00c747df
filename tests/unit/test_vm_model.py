"""VM specs validated at the edge, records round-tripping through the store, status messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from auraed.api.aurae.vms import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.server.rpc import generic_handler
from auraed.vms.model import (
    DEFAULT_MEMORY_MIB,
    DiskSpec,
    NetInfo,
    RunInfo,
    State,
    VmRecord,
    host_memory_mib,
    parse_vm,
)
from auraed.vms.servicer import SERVICE_NAME, VmServicer, status_message
from auraed.vms.vms import VmView


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name in ("vmlinuz", "initramfs.img", "rootfs.img", "config.img"):
        (tmp_path / name).write_bytes(b"x" * 512)
        paths[name] = str(tmp_path / name)
    return paths


def vm(files: dict[str, str], **fields: object) -> pb.VirtualMachine:
    values: dict[str, object] = {"name": "web", "kernel": files["vmlinuz"], **fields}
    return pb.VirtualMachine(**values)  # type: ignore[arg-type]


def expect(kind: ErrorKind, message: pb.VirtualMachine | None, *words: str, **kwargs: int) -> AuraeError:
    with pytest.raises(AuraeError) as caught:
        parse_vm(message, **kwargs)
    assert caught.value.kind is kind, caught.value.message
    for word in words:
        assert word in caught.value.message
    return caught.value


def test_defaults(files: dict[str, str]) -> None:
    spec = parse_vm(vm(files))
    assert (spec.vcpus, spec.memory_mib, spec.backend, spec.role, spec.network) == (
        1,
        DEFAULT_MEMORY_MIB,
        "",
        "",
        False,
    )
    assert spec.initramfs == spec.root_disk == ""
    assert spec.files() == [("vm.kernel", files["vmlinuz"])]


def test_full_spec(files: dict[str, str]) -> None:
    spec = parse_vm(
        vm(
            files,
            vcpus=2,
            memory_mib=256,
            initramfs=files["initramfs.img"],
            root_disk=files["rootfs.img"],
            extra_disks=[
                pb.Disk(path=files["config.img"]),
                pb.Disk(path=files["config.img"], writable=True, serial="scratch"),
            ],
            kernel_args=["quiet", "auraed.debug=1"],
            network=True,
            backend="qemu",
            role="guest",
        )
    )
    assert spec.extra_disks == (
        DiskSpec(files["config.img"], False, "disk1"),
        DiskSpec(files["config.img"], True, "scratch"),
    )
    assert spec.kernel_args == ("quiet", "auraed.debug=1")
    assert [field for field, _ in spec.files()] == [
        "vm.kernel",
        "vm.initramfs",
        "vm.root_disk",
        "vm.extra_disks[0].path",
        "vm.extra_disks[1].path",
    ]
    message = spec.to_message()
    assert message.extra_disks[0].serial == "disk1"
    assert message.role == "guest"


def test_missing_files_are_not_found_naming_the_path(files: dict[str, str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "vmlinuz")
    expect(ErrorKind.NOT_FOUND, vm(files, kernel=missing), "vm.kernel", missing)
    expect(ErrorKind.NOT_FOUND, vm(files, initramfs=missing), "vm.initramfs", missing)
    expect(ErrorKind.NOT_FOUND, vm(files, root_disk=missing), "vm.root_disk", missing)
    expect(
        ErrorKind.NOT_FOUND,
        vm(files, extra_disks=[pb.Disk(path=missing)]),
        "vm.extra_disks[0].path",
        missing,
    )


def test_bad_paths(files: dict[str, str], tmp_path: Path) -> None:
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, kernel=""), "vm.kernel", "required")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, kernel="vmlinuz"), "absolute")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, kernel=str(tmp_path)), "not a regular file")
    comma = tmp_path / "a,b"
    comma.write_bytes(b"x")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, root_disk=str(comma)), "comma")


def test_memory_beyond_the_host(files: dict[str, str]) -> None:
    expect(
        ErrorKind.INVALID_ARGUMENT,
        vm(files, memory_mib=2048),
        "vm.memory_mib",
        "1024 MiB",
        memory_limit_mib=1024,
    )
    total = host_memory_mib()
    assert total > 0
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, memory_mib=total + 1), "more than the host has")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, memory_mib=16), "minimum")


def test_bad_fields(files: dict[str, str]) -> None:
    expect(ErrorKind.INVALID_ARGUMENT, None, "vm", "required")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, name="Web_1"), "vm.name")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, vcpus=256), "vm.vcpus")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, backend="firecracker"), "vm.backend")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, role="root"), "vm.role")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, kernel_args=["a b"]), "vm.kernel_args[0]")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, kernel_args=["ok", ""]), "vm.kernel_args[1]")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, kernel_args=["x" * 900, "y" * 900]), "bytes")
    disk = pb.Disk(path=files["config.img"], serial="root")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, extra_disks=[disk]), "vm.extra_disks[0].serial")
    disk = pb.Disk(path=files["config.img"], serial="a serial")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, extra_disks=[disk]), "vm.extra_disks[0].serial")
    expect(ErrorKind.INVALID_ARGUMENT, vm(files, extra_disks=[pb.Disk(path=files["config.img"])] * 17), "16")


def test_record_round_trip(files: dict[str, str]) -> None:
    spec = parse_vm(vm(files, extra_disks=[pb.Disk(path=files["config.img"])], kernel_args=["a=1"]))
    record = VmRecord(
        spec=spec,
        backend="qemu",
        run_dir="/run/aurae/vms/web",
        state=State.RUNNING,
        net=NetInfo(3, "atap3", "10.213.0.13", "10.213.0.14", 30, "02:ae:0a:d5:00:0e"),
        run=RunInfo(1234, 5678, "/run/aurae/vms/web/qmp.sock", "/run/aurae/vms/web/console.log", "tcg"),
        console_tail=["a", "b"],
    )
    assert VmRecord.from_doc(record.to_doc()) == record
    assert record.net is not None and record.net.netmask == "255.255.255.252"


def test_a_state_is_told_with_its_reason(files: dict[str, str]) -> None:
    record = VmRecord(spec=parse_vm(vm(files)), backend="qemu", run_dir="/run/aurae/vms/web")
    for state, reason, told in [
        (State.CRASHED, "killed by signal 9", "crashed (killed by signal 9)"),
        (State.STOPPED, "stopped: the guest powered off", "stopped: the guest powered off"),
        (State.STOPPED, "stopped", "stopped"),
        (State.ALLOCATED, "", "allocated"),
    ]:
        record.state, record.reason = state, reason
        assert record.state_with_reason() == told


def test_status_message_and_handler(files: dict[str, str]) -> None:
    spec = parse_vm(vm(files, network=True))
    record = VmRecord(
        spec=spec,
        backend="qemu",
        run_dir="/run/aurae/vms/web",
        state=State.RUNNING,
        net=NetInfo(0, "atap0", "10.213.0.1", "10.213.0.2", 30, "02:ae:0a:d5:00:02"),
    )
    running = status_message(VmView(record, "running", 42, "10.213.0.2:8080"))
    assert running.state == pb.VmState.RUNNING
    assert (running.host_address, running.guest_address, running.address) == (
        "10.213.0.1/30",
        "10.213.0.2/30",
        "10.213.0.2:8080",
    )
    assert status_message(VmView(record, "paused", 42, "")).state == pb.VmState.PAUSED
    assert status_message(VmView(record, "unreachable: timeout", 42, "")).state == pb.VmState.RUNNING
    record.state = State.CRASHED
    assert status_message(VmView(record, "", 0, "")).state == pb.VmState.CRASHED
    # Every RPC of the proto has its method: the daemon can serve it.
    generic_handler(SERVICE_NAME, VmServicer(None, None))  # type: ignore[arg-type]
