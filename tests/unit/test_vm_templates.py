"""Templates and clones without QEMU: their command lines, shapes, and the guest's identity."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from auraed.bootargs import IDENTITY_PORT, BootArgs
from auraed.init import identity
from auraed.state.store import Store
from auraed.vms.backend import Backend, LaunchNet, MemoryImage
from auraed.vms.guests import hostname_of
from auraed.vms.model import VmSpec
from auraed.vms.qemu import QemuBackend
from auraed.vms.templates import (
    TemplateRecord,
    Templates,
    TemplateShape,
    TemplateState,
    identity_message,
    why_rebuilt,
)
from tests.unit.test_vm_qemu import SPEC, command, option

TEMPLATE = dataclasses.replace(
    SPEC,
    net=LaunchNet("", "52:54:00:a0:00:00", "", "", ""),
    image=MemoryImage("/run/aurae/templates/t/build-1/memory", "/run/aurae/templates/t/build-1/state", False),
)
CLONE = dataclasses.replace(
    SPEC,
    image=MemoryImage("/run/aurae/templates/t/build-1/memory", "/run/aurae/templates/t/build-1/state", True),
)


@pytest.mark.parametrize("machine", ["microvm", "q35"])
def test_a_template_and_its_clone_have_the_same_devices_and_differ_in_their_ram_and_network(
    machine: str,
) -> None:
    template, clone = command(machine, spec=TEMPLATE), command(machine, spec=CLONE)
    assert option(template, "-M")[0].endswith(",memory-backend=ram0")
    memory = "memory-backend-file,id=ram0,size=384M,mem-path=/run/aurae/templates/t/build-1/memory"
    assert f"{memory},share=on" in option(template, "-object")
    assert f"{memory},share=off" in option(clone, "-object")
    # The template's NIC has no peer; the clone's is on its tap. Same devices, in the same order.
    assert not option(template, "-netdev") and option(clone, "-netdev")
    nic = "virtio-net-device" if machine == "microvm" else "virtio-net-pci"
    strip = [
        d.replace("netdev=net0,", "").replace(SPEC.net.mac if SPEC.net else "", "M")
        for d in option(clone, "-device")
    ]
    assert strip == [d.replace("52:54:00:a0:00:00", "M") for d in option(template, "-device")]
    assert any(d.startswith(nic) for d in strip)
    port = f"virtserialport,bus=identity-bus.0,chardev=identity,name={IDENTITY_PORT}"
    assert port in option(template, "-device")
    assert "socket,id=identity,path=/run/aurae/vms/web/identity.sock,server=on,wait=off" in option(
        clone, "-chardev"
    )
    assert option(clone, "-incoming") == ["defer"] and not option(template, "-incoming")
    assert not option(command(machine), "-incoming") and "-object" in command(machine)


def spec(**fields: object) -> VmSpec:
    values: dict[str, object] = {
        "name": "pod-vm",
        "vcpus": 1,
        "memory_mib": 512,
        "kernel": "/g/vmlinuz",
        "initramfs": "/g/initramfs.img",
        "root_disk": "/g/rootfs.img",
        "extra_disks": (),
        "kernel_args": ("transparent_hugepage=madvise", "auraed.hostname=web-0"),
        "network": True,
        "backend": "qemu",
        "role": "guest",
        "template": "auto",
    }
    values.update(fields)
    return VmSpec(**values)  # type: ignore[arg-type]


def test_a_shape_leaves_out_the_identity_and_the_hostname_is_the_last_one_asked_for() -> None:
    shape = TemplateShape.of(spec())
    assert shape.kernel_args == ("transparent_hugepage=madvise",)
    assert TemplateShape.of(spec(name="other", kernel_args=("transparent_hugepage=madvise",))) == shape
    assert TemplateShape.of(spec(memory_mib=768)).key() != shape.key()
    assert hostname_of(spec()) == "web-0"
    assert hostname_of(spec(kernel_args=("auraed.hostname=a", "auraed.hostname=b"))) == "b"
    assert hostname_of(spec(kernel_args=())) == "pod-vm"
    assert BootArgs.parse("auraed.role=guest auraed.template=1").template
    assert not BootArgs.parse("auraed.role=guest").template


def test_the_guest_parses_an_identity_and_writes_its_config_owner_only(tmp_path: Path) -> None:
    message = identity_message("g1", "g1", None, {"auraed.toml": "x = 1\n", "pki/server.key": "KEY"})
    line = json.dumps(message).encode()
    assert identity.parse(line)["name"] == "g1"
    for bad in (b"nope", b"{}", json.dumps({**message, "time_ns": "now"}).encode()):
        with pytest.raises(identity.IdentityError):
            identity.parse(bad)
    target = tmp_path / "etc-aurae"
    target.mkdir()
    # A tmpfs is mounted at the target unless one is there: write into a mount point we made.
    from auraed.system.namespaces import mount, umount

    mount("tmpfs", str(target), "tmpfs", 0, "mode=0700")
    try:
        identity.write_config(message["files"], str(target))
        assert (target / "auraed.toml").read_text() == "x = 1\n"
        assert (target / "pki" / "server.key").stat().st_mode & 0o777 == 0o600
        with pytest.raises(identity.IdentityError):
            identity.write_config({"../escape": "x"}, str(target))
    finally:
        umount(str(target))


def test_the_identity_port_is_found_by_its_name(tmp_path: Path) -> None:
    ports = tmp_path / "sys" / "class" / "virtio-ports"
    for port, name in (("vport0p1", "other"), ("vport3p1", IDENTITY_PORT)):
        (ports / port).mkdir(parents=True)
        (ports / port / "name").write_text(name + "\n")
    assert identity.find_port(IDENTITY_PORT, str(tmp_path / "sys"), "/dev") == "/dev/vport3p1"
    assert identity.find_port("missing", str(tmp_path / "sys"), "/dev") == ""


def test_the_debug_console_is_part_of_a_template_s_digest_and_record_only_when_on(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"kernel")
    shape = dataclasses.replace(
        TemplateShape.of(spec(), "microvm"), kernel=str(kernel), initramfs="", root_disk=""
    )
    store = Store(tmp_path / "state.db")
    try:
        off, on = QemuBackend(machine="microvm"), QemuBackend(machine="microvm", debug_console=True)
        templates = Templates(store, {"qemu": off}, tmp_path / "templates", 1.0, dict)
        assert templates.digest(shape, on) != templates.digest(shape, off)
        # Off, the digest is what it was before the debug console could be on a template (and,
        # on microvm, which has no room, before templates had room).
        kernel_digest = hashlib.sha256(b"kernel").hexdigest()
        before = hashlib.sha256("\n".join([kernel_digest, "microvm", "tcg"]).encode()).hexdigest()
        assert templates.digest(shape, off) == before
        # On q35 the room is in it: a change of vm_max_vcpus (or memory, slots) rebuilds it.
        q35 = QemuBackend(machine="q35", max_vcpus=4, max_memory_mib=4096, memory_slots=8)
        q35_shape = dataclasses.replace(shape, machine="q35")
        with_room = "\n".join([kernel_digest, "q35", "tcg", "room 4 4096 8"])
        assert templates.digest(q35_shape, q35) == hashlib.sha256(with_room.encode()).hexdigest()
        fewer = QemuBackend(machine="q35", max_vcpus=2, max_memory_mib=4096, memory_slots=8)
        assert templates.digest(q35_shape, fewer) != templates.digest(q35_shape, q35)
    finally:
        store.close()
    record = TemplateRecord("t", shape, "qemu", "/run/aurae/templates/t", TemplateState.READY, "d")
    doc = record.to_doc()
    del doc["debug_console"]  # a record saved before the field: made without the port
    old = TemplateRecord.from_doc(doc)
    assert not old.debug_console and not old.image().debug_console
    assert why_rebuilt(old, "d2", on) == "vm_debug_console is on now"
    assert why_rebuilt(old, "d2", off) == "its files, machine type, room or accelerator changed"
    made = dataclasses.replace(old, debug_console=True)
    assert TemplateRecord.from_doc(made.to_doc()).image().debug_console


def test_where_clones_grow_one_template_of_the_base_size_serves_every_vm_within_its_room(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    try:
        backends: dict[str, Backend] = {
            "qemu": QemuBackend(machine="microvm", max_vcpus=3, max_memory_mib=2048, memory_slots=4),
        }
        templates = Templates(store, backends, tmp_path / "templates", 1.0, dict, base_memory_mib=256)
        small, big = spec(machine="q35"), spec(machine="q35", vcpus=2, memory_mib=1000)
        base = templates.shape_for(small, "qemu")
        assert (base.vcpus, base.memory_mib, base.machine) == (1, 256, "q35")
        assert templates.shape_for(big, "qemu") == base  # one template for both
        assert templates.clone_problem(small, "qemu") is None and templates.clone_problem(big, "qemu") is None
        too_small = templates.clone_problem(spec(machine="q35", memory_mib=128), "qemu")
        assert too_small is not None and "never shrunk" in too_small and "vm_template_memory_mib" in too_small
        too_many = templates.clone_problem(spec(machine="q35", vcpus=4), "qemu")
        assert too_many is not None and "vm_max_vcpus" in too_many
        # In whole blocks: 256 + 1792 = 2048 MiB fits, 2100 would be 2176 MiB.
        assert templates.clone_problem(spec(machine="q35", memory_mib=2000), "qemu") is None
        too_much = templates.clone_problem(spec(machine="q35", memory_mib=2100), "qemu")
        assert too_much is not None and "not 2176 MiB" in too_much and "vm_max_memory_mib" in too_much
        # microvm cannot grow: its template is the VM's own shape, every shape its own.
        exact = templates.shape_for(spec(), "qemu")
        assert (exact.vcpus, exact.memory_mib, exact.machine) == (1, 512, "microvm")
        assert templates.clone_problem(spec(), "qemu") is None
    finally:
        store.close()


def test_a_named_template_s_room_and_a_record_saved_before_it(tmp_path: Path) -> None:
    shape = TemplateShape.of(spec(), "q35")
    record = TemplateRecord("t", shape, "qemu", "/run/t", TemplateState.READY, "d", machine="q35",
                            max_vcpus=3, max_memory_mib=2048, memory_slots=4)  # fmt: skip
    assert record.room is not None and record.image().room == record.room
    assert (record.image().vcpus, record.image().memory_mib) == (1, 512)
    assert record.fit_problem(2, 768) is None
    assert "never shrunk" in (record.fit_problem(1, 256) or "")
    # A record saved before shapes named their machine and templates had room: its machine is
    # the record's, no room, and its clones are its size.
    doc = record.to_doc()
    del doc["shape"]["machine"], doc["max_vcpus"], doc["max_memory_mib"], doc["memory_slots"]
    old = TemplateRecord.from_doc(doc)
    assert old.shape == shape and old.room is None and old.image().room is None
    assert old.fit_problem(1, 512) is None and "its size" in (old.fit_problem(2, 512) or "")


def test_a_grow_the_guest_cannot_read_fails_its_identity() -> None:
    for bad in (
        {"cpus": "2", "memory_mib": 0},
        {"cpus": 0, "memory_mib": 0},
        {"cpus": 2, "memory_mib": -1},
        "2",
    ):
        with pytest.raises(identity.IdentityError):
            identity.online_grown(bad, 0)
