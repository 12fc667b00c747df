"""``aer vm``: virtual machines, guests with their own auraed or any kernel."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from auraed.api.aurae.vms import v0 as vms_pb
from auraed.client.cli.arguments import add_command, add_group, grace_ms, unsigned
from auraed.client.cli.calls import VMS, CliError, call, call_timeout, grace_slack, session
from auraed.client.cli.output import console, emit, print_json, report
from auraed.client.client import AuraeClient

VM_START_SLACK_MS = 300_000  # a guest booting under emulation takes a while to answer


def _vm_line(status: Any) -> str:
    state = vms_pb.VmState(status.state).name
    where = f" at {status.address}" if status.address else ""
    reason = f" ({status.reason})" if status.reason else ""
    return f"{status.vm.name}: {state}{where}{reason}"


def cmd_vm_allocate(args: argparse.Namespace) -> int:
    vm = vms_pb.VirtualMachine(
        name=args.name,
        vcpus=args.vcpus,
        memory_mib=args.memory,
        kernel=_absolute(args.kernel),
        initramfs=_absolute(args.initramfs),
        root_disk=_absolute(args.root_disk),
        kernel_args=args.kernel_arg or [],
        network=args.network or args.guest,
        role="guest" if args.guest or args.template else (args.role or ""),
        template=args.template or "",
    )
    reply = call(args, VMS, "Allocate", vms_pb.VmServiceAllocateRequest(vm=vm))
    report(args, reply, f"allocated {_vm_line(reply.status)}")
    return 0


def _absolute(path: str | None) -> str:
    return str(Path(path).absolute()) if path else ""


def cmd_vm_start(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceStartRequest(name=args.name, wait_for_console=args.wait_for_console or "")
    waiting = f"starting VM {args.name}" + (
        f" until {args.wait_for_console!r} is on its console" if args.wait_for_console else ""
    )
    reply = call(args, VMS, "Start", request, slack_ms=VM_START_SLACK_MS, waiting=waiting)
    ready = f", ready in {reply.console_ready_ms / 1000:.1f} s" if reply.console_ready_ms else ""
    report(args, reply, f"started {_vm_line(reply.status)}{ready}")
    return 0


def cmd_vm_stop(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceStopRequest(name=args.name, timeout_ms=args.grace)
    waiting = f"stopping VM {args.name}"
    reply = call(args, VMS, "Stop", request, slack_ms=grace_slack(args.grace), waiting=waiting)
    report(args, reply, f"stopped {_vm_line(reply.status)}")
    return 0


def cmd_vm_free(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceFreeRequest(name=args.name, timeout_ms=args.grace)
    waiting = f"freeing VM {args.name}"  # a running one is stopped first
    reply = call(args, VMS, "Free", request, slack_ms=grace_slack(args.grace), waiting=waiting)
    report(args, reply, f"freed VM {args.name}")
    return 0


def cmd_vm_resize(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceResizeRequest(name=args.name, vcpus=args.vcpus, memory_mib=args.memory)
    waiting = f"growing VM {args.name}"
    reply = call(args, VMS, "Resize", request, slack_ms=VM_START_SLACK_MS, waiting=waiting)
    vm = reply.status.vm
    guest = (
        f"; its guest has {reply.guest_online_cpus} CPUs online and {reply.guest_mem_total_kib // 1024} MiB "
        f"MemTotal ({reply.resize_ms} ms)"
        if reply.guest_online_cpus
        else ""
    )
    report(args, reply, f"VM {vm.name}: {vm.vcpus} vCPUs, {vm.memory_mib} MiB{guest}")
    return 0


def cmd_vm_list(args: argparse.Namespace) -> int:
    reply = call(args, VMS, "List", vms_pb.VmServiceListRequest())
    if args.json:
        print_json(reply)
        return 0
    table = Table("NAME", "STATE", "BACKEND", "ADDRESS", "PID", "TAP", box=None, header_style="bold")
    for status in reply.vms:
        table.add_row(
            status.vm.name,
            vms_pb.VmState(status.state).name,
            f"{status.backend}/{status.accelerator}",
            status.address or "-",
            str(status.pid or "-"),
            status.tap or "-",
        )
    console.print(table if reply.vms else "no VMs")
    return 0


def cmd_vm_console(args: argparse.Namespace) -> int:
    if args.shell:
        if args.follow or args.tail is not None:
            raise CliError("vm console: --shell takes neither --follow nor --tail")
        from auraed.client.cli.vm_shell import cmd_vm_shell  # termios, tty: only for a shell

        return cmd_vm_shell(args)
    request = vms_pb.VmServiceGetConsoleRequest(name=args.name, tail=args.tail, follow=args.follow)
    timeout = call_timeout(args, open_ended=True)

    async def body(client: AuraeClient) -> None:
        async for reply in client.stream(VMS, "GetConsole", request, timeout):
            emit(args, reply, reply.line)

    session(args, body)
    return 0


def _template_line(status: Any) -> str:
    shape = status.template
    clones = f", clones: {', '.join(status.clones)}" if status.clones else ""
    reason = f" ({status.reason})" if status.reason else ""
    return (
        f"{shape.name}: {status.state}{reason}, {shape.vcpus} vCPU, {shape.memory_mib} MiB, "
        f"{status.memory_resident_bytes >> 20} MiB resident{clones}"
    )


def cmd_template_create(args: argparse.Namespace) -> int:
    template = vms_pb.Template(
        name=args.name,
        vcpus=args.vcpus,
        memory_mib=args.memory,
        kernel=_absolute(args.kernel),
        initramfs=_absolute(args.initramfs),
        root_disk=_absolute(args.root_disk),
        kernel_args=args.kernel_arg or [],
    )
    request = vms_pb.VmServiceCreateTemplateRequest(template=template)
    waiting = f"making VM template {args.name} (a guest boots once)"
    reply = call(args, VMS, "CreateTemplate", request, slack_ms=VM_START_SLACK_MS, waiting=waiting)
    made = f", made in {reply.status.build_ms / 1000:.1f} s" if reply.status.build_ms else ""
    report(args, reply, f"template {_template_line(reply.status)}{made}")
    return 0


def cmd_template_list(args: argparse.Namespace) -> int:
    reply = call(args, VMS, "ListTemplates", vms_pb.VmServiceListTemplatesRequest())
    if args.json:
        print_json(reply)
        return 0
    table = Table(
        "NAME", "STATE", "SHAPE", "ROOM", "RESIDENT", "CLONES", "BUILT IN", box=None, header_style="bold"
    )
    for status in reply.templates:
        shape = status.template
        debug = ", debug console" if status.debug_console else ""
        room = f"{status.max_vcpus} vCPU, {status.max_memory_mib} MiB" if status.max_vcpus else "-"
        machine = f", {status.machine}" if status.machine else ""
        table.add_row(
            shape.name,
            status.state,
            f"{shape.vcpus} vCPU, {shape.memory_mib} MiB{machine}{debug}",
            room,
            f"{status.memory_resident_bytes >> 20} MiB",
            ", ".join(status.clones) or "-",
            f"{status.build_ms / 1000:.1f} s" if status.build_ms else "-",
        )
    console.print(table if reply.templates else "no VM templates")
    return 0


def cmd_template_remove(args: argparse.Namespace) -> int:
    reply = call(args, VMS, "RemoveTemplate", vms_pb.VmServiceRemoveTemplateRequest(name=args.name))
    report(args, reply, f"removed VM template {args.name}")
    return 0


def _add_template_commands(vm: Any) -> None:
    template = add_group(vm, "template", "guest templates: booted once, cloned for each guest naming one")
    create = add_command(template, "create", cmd_template_create, "make a template (a guest boots once)")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--vcpus", type=unsigned(32), default=0, help="virtual CPUs (default 1)")
    create.add_argument(
        "--memory", type=unsigned(64), default=0, metavar="MIB", help="memory in MiB (default 512)"
    )
    create.add_argument("--kernel", help="kernel image (default: the guest image's)")
    create.add_argument("--initramfs")
    create.add_argument("--root-disk")
    create.add_argument("--kernel-arg", action="append", metavar="ARG", help="extra kernel argument")
    add_command(template, "ls", cmd_template_list, "the templates and the running VMs cloned from them")
    remove = add_command(template, "rm", cmd_template_remove, "remove a template no running VM uses")
    remove.add_argument("name", metavar="NAME")


def add_commands(subparsers: Any) -> None:
    vm = add_group(subparsers, "vm", "virtual machines: guests with their own auraed, or any kernel")
    allocate = add_command(vm, "allocate", cmd_vm_allocate, "define a VM (and its tap and addresses)")
    allocate.add_argument("name", metavar="NAME")
    allocate.add_argument("--guest", action="store_true", help="boot the guest image with auraed as PID 1")
    allocate.add_argument("--vcpus", type=unsigned(32), default=0, help="virtual CPUs (default 1)")
    allocate.add_argument(
        "--memory", type=unsigned(64), default=0, metavar="MIB", help="memory in MiB (default 512)"
    )
    allocate.add_argument("--kernel", help="kernel image (the guest image's with --guest)")
    allocate.add_argument("--initramfs")
    allocate.add_argument("--root-disk", help="read-only root disk image")
    allocate.add_argument("--kernel-arg", action="append", metavar="ARG", help="extra kernel argument")
    allocate.add_argument("--network", action="store_true", help="a tap and an address pair")
    allocate.add_argument("--role", help="auraed role passed on the kernel command line")
    allocate.add_argument(
        "--template",
        metavar="NAME",
        help="a guest cloned from this template (auto: the host's of its shape) instead of booted",
    )
    start = add_command(vm, "start", cmd_vm_start, "boot a VM; a guest is ready once its auraed serves")
    start.add_argument("name", metavar="NAME")
    start.add_argument("--wait-for-console", metavar="TEXT", help="return once TEXT is on the console")
    stop = add_command(
        vm, "stop", cmd_vm_stop, "power off (ACPI), forced after the grace period", deadline=False
    )
    stop.add_argument("name", metavar="NAME")
    stop.add_argument(
        "--grace", type=grace_ms, metavar="SECONDS", help="to power off before the VMM is ended"
    )
    free = add_command(vm, "free", cmd_vm_free, "stop a VM and remove its tap, files and record")
    free.add_argument("name", metavar="NAME")
    free.add_argument("--grace", type=grace_ms, metavar="SECONDS", help="to power off, if running")
    resize = add_command(
        vm, "resize", cmd_vm_resize, "grow a running VM (q35): hotplug vCPUs and memory, onlined in its guest"
    )
    resize.add_argument("name", metavar="NAME")
    resize.add_argument("--vcpus", type=unsigned(32), default=0, help="vCPUs it is to have (default: as now)")
    resize.add_argument(
        "--memory",
        type=unsigned(64),
        default=0,
        metavar="MIB",
        help="memory in MiB, at least (default: as now)",
    )
    add_command(vm, "ls", cmd_vm_list, "the VMs, with state read from their VMM")
    console_ = add_command(
        vm, "console", cmd_vm_console, "the serial console (--shell: a shell in the guest)"
    )
    console_.add_argument("name", metavar="NAME")
    console_.add_argument("-f", "--follow", action="store_true")
    console_.add_argument("--tail", type=unsigned(32), default=None, metavar="N")
    console_.add_argument(
        "--shell",
        action="store_true",
        help="an interactive shell in the guest over its debug port (the host's vm_debug_console; "
        "raw terminal: exit or ^D ends it)",
    )
    _add_template_commands(vm)
