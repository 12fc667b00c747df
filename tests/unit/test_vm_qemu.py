"""QEMU command lines (microvm/q35, TCG/KVM) and the host facts they are built from."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from auraed.vms.backend import LaunchDisk, LaunchNet, LaunchSpec, MemoryImage, Room
from auraed.vms.errors import VmError
from auraed.vms.model import RunInfo, grown_memory_mib, host_memory_mib
from auraed.vms.qemu import QemuBackend, build_command, copy_sparse, host_tsc_khz

SPEC = LaunchSpec(
    name="web",
    vcpus=2,
    memory_mib=384,
    kernel="/images/vmlinuz",
    initramfs="/images/initramfs.img",
    disks=(LaunchDisk("/images/rootfs.img", False, "root"), LaunchDisk("/images/config.img", False, "disk1")),
    cmdline="auraed.hostname=web",
    net=LaunchNet("atap7", "02:ae:0a:d5:00:1e", "10.213.0.29", "10.213.0.30", "255.255.255.252"),
    run_dir=Path("/run/aurae/vms/web"),
)


def command(
    machine: str = "microvm", accelerator: str = "tcg", spec: LaunchSpec = SPEC, room: Room | None = None
) -> list[str]:
    return build_command(
        spec,
        binary="qemu-system-x86_64",
        machine=machine,
        accelerator=accelerator,
        qmp_socket=Path("/run/aurae/vms/web/qmp.sock"),
        console_path=Path("/run/aurae/vms/web/console.log"),
        kernel_cmdline="console=ttyS0 auraed.hostname=web",
        room=room,
    )


def option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


def test_microvm_tcg() -> None:
    argv = command()
    assert option(argv, "-M") == ["microvm,x-option-roms=off,isa-serial=on,rtc=on"]
    assert option(argv, "-accel") == ["tcg"] and option(argv, "-cpu") == ["max"]
    assert option(argv, "-smp") == ["2"] and option(argv, "-m") == ["384M"]
    assert option(argv, "-kernel") == ["/images/vmlinuz"] and option(argv, "-initrd") == [
        "/images/initramfs.img"
    ]
    assert option(argv, "-append") == ["console=ttyS0 auraed.hostname=web"]
    assert option(argv, "-drive") == [
        "id=disk0,file=/images/rootfs.img,format=raw,if=none,readonly=on",
        "id=disk1,file=/images/config.img,format=raw,if=none,readonly=on",
    ]
    devices = option(argv, "-device")
    assert "virtio-blk-device,drive=disk0,serial=root" in devices
    assert "virtio-blk-device,drive=disk1,serial=disk1" in devices
    assert "virtio-net-device,netdev=net0,mac=02:ae:0a:d5:00:1e" in devices
    assert option(argv, "-netdev") == ["tap,id=net0,ifname=atap7,script=no,downscript=no"]
    assert option(argv, "-qmp") == ["unix:/run/aurae/vms/web/qmp.sock,server=on,wait=off"]
    assert option(argv, "-chardev") == ["file,id=console,path=/run/aurae/vms/web/console.log"]
    assert option(argv, "-serial") == ["chardev:console"]
    assert "-no-reboot" in argv and "-nodefaults" in argv and "-daemonize" not in argv


def test_q35_kvm_and_writable_disk() -> None:
    spec = LaunchSpec(
        **{**SPEC.__dict__, "disks": (LaunchDisk("/images/scratch.img", True, "scratch"),), "net": None}
    )
    argv = command("q35", "kvm", spec)
    assert option(argv, "-M") == ["q35"]
    assert option(argv, "-accel") == ["kvm"] and option(argv, "-cpu") == ["host"]
    assert option(argv, "-drive") == ["id=disk0,file=/images/scratch.img,format=raw,if=none,readonly=off"]
    devices = option(argv, "-device")
    assert "virtio-blk-pci,drive=disk0,serial=scratch" in devices
    assert not any("net" in d for d in devices) and "-netdev" not in argv
    with pytest.raises(ValueError):
        command("pc")


def test_tsc_khz(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: x\ncpu MHz\t\t: 2100.000\n\nprocessor\t: 1\ncpu MHz\t\t: 2099.5\n"
    )
    assert host_tsc_khz(cpuinfo) == 2100000
    cpuinfo.write_text("processor\t: 0\n")
    assert host_tsc_khz(cpuinfo) is None
    assert host_tsc_khz(tmp_path / "absent") is None
    real = host_tsc_khz()
    assert real is not None and real > 100_000


def test_kernel_args_and_accelerator() -> None:
    microvm = QemuBackend(machine="microvm", kvm_usable=lambda: False)
    assert microvm.kernel_args() == ["console=ttyS0", f"tsc_early_khz={host_tsc_khz()}"]
    assert microvm.accelerator == "tcg"
    q35 = QemuBackend(machine="q35", kvm_usable=lambda: True)
    # Memory a Resize plugs is onlined by the guest's kernel itself; the room for it costs no
    # bounce buffers (virtio needs none).
    assert q35.kernel_args() == ["console=ttyS0", "memhp_default_state=online", "swiotlb=noforce"]
    assert q35.accelerator == "kvm"
    assert QemuBackend(binary="/nonexistent/qemu").problem() is not None
    assert QemuBackend().problem() is None


@pytest.mark.parametrize(
    ("machine", "device"), [("microvm", "vhost-user-fs-device"), ("q35", "vhost-user-fs-pci")]
)
def test_a_shared_directory_is_virtio_fs_over_shared_memory(machine: str, device: str) -> None:
    """virtiofsd maps the guest's RAM (vhost-user): a shared memfd, the machine's memory; on
    microvm the virtio-mmio devices are modern (libvhost-user serves no legacy device)."""
    spec = dataclasses.replace(SPEC, shared_dir="/run/aurae/pod-shares/p1")
    argv = command(machine, spec=spec)
    assert option(argv, "-M")[0].endswith(",memory-backend=ram0")
    assert option(argv, "-object")[-1] == "memory-backend-memfd,id=ram0,size=384M,share=on"
    assert "socket,id=fs0,path=/run/aurae/vms/web/virtiofs.sock" in option(argv, "-chardev")
    assert f"{device},chardev=fs0,tag=aurae-share" in option(argv, "-device")
    legacy_off = ["virtio-mmio.force-legacy=false"] if machine == "microvm" else []
    assert option(argv, "-global") == legacy_off
    # Without a share: private RAM and legacy mmio, as every VM had before.
    plain = command(machine)
    assert "memory-backend" not in option(plain, "-M")[0] and option(plain, "-global") == []


def test_a_vmm_starts_in_its_cgroup_before_it_runs(tmp_path: Path) -> None:
    """The shell joins each cgroup (here: files standing in for cgroup.procs), then becomes the
    command with its arguments intact and its pid unchanged."""
    import subprocess

    from auraed.vms.backend import in_cgroup

    assert in_cgroup(["qemu", "-x"], ()) == ["qemu", "-x"]
    procs = (tmp_path / "a.procs", tmp_path / "b.procs")
    argv = in_cgroup(["sh", "-c", 'echo "$$ $1"', "sh", "two words"], tuple(map(str, procs)))
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    output, _ = process.communicate()
    assert output.strip() == f"{process.pid} two words"  # the same process: the VMM's pid is ours
    assert [p.read_text() for p in procs] == ["0\n", "0\n"]
    failing = in_cgroup(["true"], (str(tmp_path / "missing" / "cgroup.procs"),))
    assert subprocess.run(failing, capture_output=True, check=False).returncode == 126


def test_a_q35_vm_starts_with_room_to_grow_and_a_microvm_one_as_before() -> None:
    room = Room(max_vcpus=4, max_memory_mib=2048, slots=10)
    argv = command("q35", room=room)
    assert option(argv, "-smp") == ["2,maxcpus=4"]
    assert option(argv, "-m") == ["384M,slots=10,maxmem=2048M"]
    # microvm cannot hotplug: its command line is what it always was, whatever the room.
    assert command("microvm", room=room) == command("microvm")
    # No room (a VM asking for as much as the maximum): plain -smp and -m (QEMU refuses slots
    # with maxmem equal to the memory).
    assert option(command("q35", room=Room(2, 384, 0)), "-smp") == ["2"]
    assert option(command("q35", room=Room(2, 384, 0)), "-m") == ["384M"]
    # With a share, the boot RAM stays the shared memfd of its size.
    shared = command("q35", spec=dataclasses.replace(SPEC, shared_dir="/run/aurae/pod-shares/p1"), room=room)
    assert option(shared, "-m") == ["384M,slots=10,maxmem=2048M"]
    assert "memory-backend-memfd,id=ram0,size=384M,share=on" in option(shared, "-object")


def test_the_room_a_vm_gets() -> None:
    q35 = QemuBackend(machine="q35", max_vcpus=8, max_memory_mib=4096, memory_slots=6)
    assert q35.room(SPEC) == Room(8, 4096, 6)
    # Defaults: the host's online CPUs and MemTotal (as Kata's default_maxvcpus and maxmem).
    host = QemuBackend(machine="q35").room(dataclasses.replace(SPEC, vcpus=1))
    assert host == Room(os.cpu_count() or 1, host_memory_mib(), 10)
    # A VM bigger than the maximum starts with room for no more; a template or clone with none
    # (a clone's command line must be its template's); microvm never has any.
    assert q35.room(dataclasses.replace(SPEC, vcpus=16, memory_mib=8192)) == Room(16, 8192, 0)
    image = MemoryImage("/run/t/memory", "/run/t/state", clone=True)
    assert q35.room(dataclasses.replace(SPEC, image=image)) == Room(0, 0, 0)
    assert QemuBackend(machine="microvm", max_vcpus=8).room(SPEC) == Room(0, 0, 0)


def test_memory_grows_in_whole_blocks() -> None:
    assert grown_memory_mib(512, 768) == 768
    assert grown_memory_mib(512, 513) == 640
    assert grown_memory_mib(512, 512) == 512 and grown_memory_mib(512, 100) == 512
    assert grown_memory_mib(384, 1000) == 1024


def test_what_cannot_grow_says_why() -> None:
    def run(machine: str, max_vcpus: int) -> RunInfo:
        return RunInfo(1, 1, "/run/qmp.sock", "/run/console.log", "tcg", machine, max_vcpus, 0)

    q35 = QemuBackend(machine="q35")
    problem = q35.grow_problem(run("microvm", 0))
    assert problem is not None and "microvm" in problem and 'vm_machine = "q35"' in problem
    problem = q35.grow_problem(run("q35", 0))
    assert problem is not None and "without room" in problem
    assert q35.grow_problem(run("q35", 2)) is None


@pytest.mark.parametrize(
    ("machine", "bus"), [("microvm", "virtio-serial-device"), ("q35", "virtio-serial-pci")]
)
def test_the_debug_console_is_a_port_only_when_on_and_a_template_s_clones_have_it_as_it_had(
    machine: str, bus: str
) -> None:
    def debug_words(argv: list[str]) -> list[str]:
        return [w for w in argv if "debug" in w and not w.startswith(f"{SPEC.name},debug-threads")]

    def built(spec: LaunchSpec, debug: bool) -> list[str]:
        return build_command(
            spec, binary="qemu-system-x86_64", machine=machine, accelerator="tcg",
            qmp_socket=Path("/q"), console_path=Path("/c"), kernel_cmdline="console=ttyS0",
            debug_console=debug,
        )  # fmt: skip

    off = built(SPEC, False)
    assert debug_words(off) == []
    assert not any("virtserialport" in w or "virtio-serial" in w for w in off)
    on = built(SPEC, True)
    assert f"{bus},id=debug-bus" in option(on, "-device")
    assert "socket,id=debug,path=/run/aurae/vms/web/debug.sock,server=on,wait=off" in option(on, "-chardev")
    assert "virtserialport,bus=debug-bus.0,chardev=debug,name=org.aurae.debug" in option(on, "-device")
    for debug in (False, True):
        image = MemoryImage("/t/ram", "/t/state", clone=False, debug_console=debug)
        template = dataclasses.replace(SPEC, image=image, run_dir=Path("/t"))
        clone = dataclasses.replace(SPEC, image=dataclasses.replace(image, clone=True))
        backend = QemuBackend(machine=machine, debug_console=True)
        # The record's word, not the daemon's setting, for a template and its clone alike.
        assert backend.debug_wanted(template) is debug and backend.debug_wanted(clone) is debug
        made, restored = built(template, debug), built(clone, debug)
        # The clone's devices are the template's, in the same order; its socket in its own run dir.
        assert option(made, "-device") == option(restored, "-device")
        sockets = [c for c in option(restored, "-chardev") if c.startswith("socket,id=debug,")]
        assert sockets == (
            ["socket,id=debug,path=/run/aurae/vms/web/debug.sock,server=on,wait=off"] if debug else []
        )
    assert QemuBackend(machine=machine, debug_console=True).debug_wanted(SPEC)
    assert not QemuBackend(machine=machine).debug_wanted(SPEC)


@pytest.mark.parametrize("machine", ["microvm", "q35"])
def test_a_q35_template_and_its_clones_have_one_free_root_port_for_hotplug(machine: str) -> None:
    for clone in (False, True):
        spec = dataclasses.replace(SPEC, image=MemoryImage("/t/ram", "/t/state", clone=clone))
        argv = build_command(
            spec, binary="qemu-system-x86_64", machine=machine, accelerator="tcg",
            qmp_socket=Path("/q"), console_path=Path("/c"), kernel_cmdline="console=ttyS0",
        )  # fmt: skip
        ports = [d for d in option(argv, "-device") if d.startswith("pcie-root-port")]
        assert ports == ([] if machine == "microvm" else ["pcie-root-port,id=hotplug0,chassis=1"])
    cold = build_command(
        SPEC, binary="qemu-system-x86_64", machine=machine, accelerator="tcg",
        qmp_socket=Path("/q"), console_path=Path("/c"), kernel_cmdline="console=ttyS0",
    )  # fmt: skip
    assert not [d for d in option(cold, "-device") if d.startswith("pcie-root-port")]


async def test_a_sparse_copy_keeps_the_holes_and_the_data(tmp_path: Path) -> None:
    source, target = tmp_path / "ram", tmp_path / "copy"
    with source.open("wb") as ram:
        ram.truncate(64 << 20)
        for mib in (0, 7, 63):
            ram.seek(mib << 20)
            ram.write(bytes([mib + 1]) * (1 << 20))
    # By a child process (python -m auraed.vms.sparse), as a clone's copy is made in its VMM's cgroup.
    took, copied = await copy_sparse(source, target)
    assert took >= 0 and copied >= 3 << 20 and copied < 64 << 20
    assert target.read_bytes() == source.read_bytes()
    assert target.stat().st_blocks * 512 < 16 << 20 and target.stat().st_mode & 0o777 == 0o600
    with pytest.raises(VmError, match=r"could not copy the template's RAM .*No such file"):
        await copy_sparse(tmp_path / "gone", tmp_path / "copy2")
    assert not (tmp_path / "copy2").exists()


def test_only_a_q35_clone_can_have_a_shared_directory() -> None:
    assert QemuBackend(machine="q35").shared_clone_problem() is None
    problem = QemuBackend(machine="microvm").shared_clone_problem()
    assert problem is not None and "hotplug" in problem and 'vm_machine = "q35"' in problem


def test_the_tcg_translation_cache_is_capped_only_when_asked_and_only_for_tcg() -> None:
    def accel(accelerator: str, cache: int) -> list[str]:
        argv = build_command(
            SPEC, binary="qemu-system-x86_64", machine="microvm", accelerator=accelerator,
            qmp_socket=Path("/q"), console_path=Path("/c"), kernel_cmdline="console=ttyS0",
            tcg_cache_mib=cache,
        )  # fmt: skip
        return option(argv, "-accel")

    assert accel("tcg", 0) == ["tcg"]
    assert accel("tcg", 32) == ["tcg,tb-size=32"]
    assert accel("kvm", 32) == ["kvm"]


def test_a_q35_template_and_its_clones_have_its_room_and_a_clone_starts_at_its_size() -> None:
    """The room is the template's (its record's), on the template's command line and each clone's
    alike; a clone of a bigger VM starts at the template's size (it is grown once restored)."""
    room = Room(3, 2048, 4)
    q35 = QemuBackend(machine="microvm", max_vcpus=8, max_memory_mib=4096)  # the VM's machine wins
    made = MemoryImage("/t/memory", "/t/state", clone=False, vcpus=1, memory_mib=256, room=room)
    template = dataclasses.replace(SPEC, vcpus=1, memory_mib=256, image=made, machine="q35")
    clone_image = dataclasses.replace(made, clone=True)
    clone = dataclasses.replace(SPEC, vcpus=2, memory_mib=640, image=clone_image, machine="q35")
    assert q35.room(template) == q35.room(clone) == room
    assert clone.boot_size() == (1, 256) and SPEC.boot_size() == (SPEC.vcpus, SPEC.memory_mib)
    for spec in (template, clone):
        argv = command("q35", spec=spec, room=q35.room(spec))
        assert option(argv, "-smp") == ["1,maxcpus=3"]
        assert option(argv, "-m") == ["256M,slots=4,maxmem=2048M"]
        assert any(o.startswith("memory-backend-file,id=ram0,size=256M,") for o in option(argv, "-object"))
    # Without room in the image (a template made before templates had it): none.
    assert q35.room(dataclasses.replace(clone, image=dataclasses.replace(clone_image, room=None))) == Room(
        0, 0, 0
    )


def test_a_vm_s_own_machine_and_the_room_a_template_of_it_gets() -> None:
    backend = QemuBackend(machine="microvm", max_vcpus=4, max_memory_mib=4096, memory_slots=6)
    assert (backend.machine_of(""), backend.machine_of("q35")) == ("microvm", "q35")
    with pytest.raises(VmError):
        backend.machine_of("pc")
    assert backend.template_room("") is None and backend.template_room("microvm") is None
    assert backend.template_room("q35") == Room(4, 4096, 6)
    assert backend.kernel_args("q35") == ["console=ttyS0", "memhp_default_state=online", "swiotlb=noforce"]
    # A cold VM asking for q35 on a microvm host gets q35's room.
    assert backend.room(dataclasses.replace(SPEC, machine="q35")) == Room(4, 4096, 6)
    assert backend.room(SPEC) == Room(0, 0, 0)
    assert backend.shared_clone_problem("q35") is None and backend.shared_clone_problem("") is not None
