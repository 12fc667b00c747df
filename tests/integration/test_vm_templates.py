"""Guests cloned from a template, for real: QEMU under TCG, the guest image's auraed, real taps.

One template is booted (~20 s here) and its clones restored from it (~30 ms each, then their
identity and the daemon's start). The first test starts three clones at once from the host's
``auto`` template and checks what each must have of its own: its address, its certificate and
key (none of which reaches the template's RAM file), its hostname, its boot id and its kernel
RNG (``/proc/sys/kernel/random/uuid`` differs after the reseed), then stops and frees them. The
second works on a copy of the image, as a restarted host would (a new Vms and Guests over the
same store: the template is recovered, not made again): a clone's clock is the host's, not the
template's (ten seconds behind by then), its SystemService reseeds and sets the time again, and
changing the image rebuilds the template while a clone of the old one keeps serving. The third
freezes a clone as it is restored: it has the host's guest_ready_timeout to take its identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.observe import v0 as observe_pb
from auraed.api.aurae.vms import v0 as pb
from auraed.client import AuraeClient
from auraed.errors import AuraeError, ErrorKind
from auraed.metrics.prometheus import DaemonMetrics
from auraed.metrics.sink import NO_METRICS, MetricsSink
from auraed.pki import PkiPaths, ensure_dev_pki
from auraed.vms.guests import Guests, GuestTrust
from auraed.vms.model import State, VmRecord, VmSpec, parse_vm
from auraed.vms.servicer import VmServicer, status_message
from auraed.vms.templates import AUTO_PREFIX, MEMORY_FILE, TemplateState
from auraed.vms.vms import Vms
from tests.integration.test_vms import VmEnv

pytestmark = pytest.mark.slow

READY_TIMEOUT = 240.0  # a template's boot, or three clones' starts, on a loaded 2-core machine
FROZEN_READY_TIMEOUT = 5.0  # the guest_ready_timeout of the host whose clone is frozen
MEMORY_MIB = 384
CELLS = "aurae.cells.v0.CellService"
OBSERVE = "aurae.observe.v0.ObserveService"


@pytest.fixture
async def env(guest_image: Path) -> AsyncIterator[VmEnv]:
    root = Path(tempfile.mkdtemp(prefix="aurae-tpl-", dir="/tmp"))  # unix socket paths are short
    made = VmEnv(root, guest_image)
    try:
        yield made
    finally:
        await made.cleanup()


def guests_over(
    env: VmEnv,
    pki: PkiPaths,
    image: Path,
    metrics: MetricsSink = NO_METRICS,
    ready_timeout: float = READY_TIMEOUT,
) -> tuple[Vms, Guests]:
    vms = env.vms()
    trust = GuestTrust(pki.ca_crt, pki.ca_key, env.root / "pki")
    guests = Guests(vms, trust, image, ready_timeout, metrics=metrics)
    return vms, guests


def clone_spec(name: str, template: str = "auto", *args: str) -> VmSpec:
    return parse_vm(
        pb.VirtualMachine(
            name=name, role="guest", template=template, memory_mib=MEMORY_MIB, kernel_args=list(args)
        )
    )


def peer_certificate(env: VmEnv, pki: PkiPaths, address: str, name: str) -> x509.Certificate:
    """The certificate the guest serves, from an mTLS handshake as the host (aurae-host)."""
    context = ssl.create_default_context(cafile=str(pki.ca_crt))
    crt = env.root / "pki" / "aurae-host.crt"
    context.load_cert_chain(crt, crt.with_suffix(".key"))
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=30) as raw,
        context.wrap_socket(raw, server_hostname=f"{name}.guest.aurae") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


async def run_in_guest(guests: Guests, name: str, shell: str) -> list[str]:
    """``shell`` in a cell of the guest (its CellService), its stdout lines."""
    client = AuraeClient((await guests.lookup(name)).channel)
    listed = (await client.call(CELLS, "List", cells_pb.CellServiceListRequest())).cells
    cells = [node.cell.name for node in listed if node.cell is not None]
    if "t" not in cells:
        await client.call(
            CELLS, "Allocate", cells_pb.CellServiceAllocateRequest(cell=cells_pb.Cell(name="t"))
        )
    executable = f"x{time.monotonic_ns()}"
    start = cells_pb.CellServiceStartRequest(
        cell_name="t", executable=cells_pb.Executable(name=executable, shell_command=shell)
    )
    await client.call(CELLS, "Start", start, timeout=60)
    request = observe_pb.ObserveServiceGetSubProcessStreamRequest(
        cell_name="t", executable_name=executable, follow=True
    )
    lines = []
    async for reply in client.stream(OBSERVE, "GetSubProcessStream", request, timeout=60):
        if reply.item.channel != observe_pb.LogChannelType.STDERR:
            lines.append(reply.item.line)
    return lines


def public_key(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


async def test_three_clones_of_the_auto_template_serve_each_with_its_own_identity(
    env: VmEnv, pki: PkiPaths, guest_image: Path
) -> None:
    metrics = DaemonMetrics()
    vms, guests = guests_over(env, pki, guest_image, metrics)
    names = ["c1", "c2", "c3"]
    for name in names:
        # The last clone takes a pod's hostname, as the CRI's vm handler asks for one.
        extra = ("auraed.hostname=pod-three",) if name == "c3" else ()
        await guests.allocate(clone_spec(name, "auto", *extra))
    booted = await asyncio.gather(*(guests.boot(n) for n in names))

    # One template, made once for all three, on first use.
    (template,) = guests.templates.all()
    assert template.name.startswith(AUTO_PREFIX) and template.auto
    # Each clone's time to serving is counted in the clone histogram (orka's NodeStatus reads it).
    assert metrics.registry.get_sample_value("auraed_vm_clone_seconds_count") == 3
    clone_total = metrics.registry.get_sample_value("auraed_vm_clone_seconds_sum")
    assert clone_total is not None and 0 < clone_total < 3 * READY_TIMEOUT
    assert (template.state, template.build) == (TemplateState.READY, 1)
    assert sorted(guests.template_users(template.name)) == names
    for b in booted:
        assert b.record.template == template.name
        assert b.record.restore_ms is not None and b.record.restore_ms < 1000, b.record.restore_ms
        assert b.ready is not None
    # What VmService says of them.
    servicer = VmServicer(vms, guests)
    listing = await servicer.list_templates(pb.VmServiceListTemplatesRequest(), None)
    (status,) = listing.templates
    assert status.template is not None
    assert (status.template.name, status.state, sorted(status.clones)) == (template.name, "ready", names)
    assert status.memory_resident_bytes > 0 and status.build_ms > 0 and status.save_ms > 0
    clone = status_message(await vms.view(vms.get("c1")))
    assert clone.template == template.name and clone.restore_ms is not None
    with pytest.raises(AuraeError) as refused:
        await servicer.remove_template(pb.VmServiceRemoveTemplateRequest(name=template.name), None)
    assert refused.value.kind == ErrorKind.FAILED_PRECONDITION and "c1" in refused.value.message

    # Each at its own address, with its own certificate (issued for it now) and key.
    certs = {}
    for name in names:
        address = vms.address(vms.get(name))
        cert = await asyncio.to_thread(peer_certificate, env, pki, address, name)
        ips = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert str(ips.get_values_for_type(x509.IPAddress)[0]) == address.rsplit(":", 1)[0]
        certs[name] = cert
    assert len({public_key(c) for c in certs.values()}) == 3
    # The template's RAM file is the clones' only in what they have not written: their keys,
    # written after the restore, are in their private pages, never in the file.
    memory = (template.build_dir / MEMORY_FILE).read_bytes()
    for cert in certs.values():
        assert public_key(cert)[-64:] not in memory

    # Their own hostname, kernel RNG (after the reseed) and boot id.
    seen = await asyncio.gather(
        *(
            run_in_guest(
                guests,
                n,
                "hostname; cat /proc/sys/kernel/random/boot_id; "
                "for i in 1 2 3; do cat /proc/sys/kernel/random/uuid; done",
            )
            for n in names
        )
    )
    hostnames = [lines[0] for lines in seen]
    assert hostnames == ["c1", "c2", "pod-three"]
    boot_ids = {lines[1] for lines in seen}
    uuids = [tuple(lines[2:5]) for lines in seen]
    assert len(boot_ids) == 3, seen
    assert len({u for sequence in uuids for u in sequence}) == 9, uuids

    for name in names:
        await guests.free(name, 0.0)
    await servicer.remove_template(pb.VmServiceRemoveTemplateRequest(name=template.name), None)
    assert not guests.templates.all()
    assert not (Path(template.run_dir)).exists()
    await guests.trust.close()


async def test_a_recovered_template_s_clones_get_the_host_s_clock_and_a_changed_image_rebuilds_it(
    env: VmEnv, pki: PkiPaths, guest_image: Path
) -> None:
    image = env.root / "image"
    image.mkdir()
    for name in ("vmlinuz", "initramfs.img", "rootfs.img"):
        shutil.copyfile(guest_image / name, image / name)
    vms, guests = guests_over(env, pki, image)
    made = await guests.create_template("t2", vcpus=1, memory_mib=MEMORY_MIB)
    assert made.state == TemplateState.READY
    saved_at = time.time()
    await vms.close()
    await guests.trust.close()

    # A restarted host: the template is recovered from the store and used as it is.
    vms, guests = guests_over(env, pki, image)
    assert guests.templates.get("t2").build == 1
    await guests.allocate(clone_spec("old", "t2"))
    # Not of the template's shape: refused before anything is made.
    with pytest.raises(AuraeError) as refused:
        await guests.allocate(parse_vm(pb.VirtualMachine(name="big", role="guest", template="t2", vcpus=2)))
    assert refused.value.kind == ErrorKind.FAILED_PRECONDITION
    assert "does not match template t2" in refused.value.message
    # The template's clock is as old as the template; the clone's is the host's.
    await asyncio.sleep(max(0.0, 10.0 - (time.time() - saved_at)))
    booted = await guests.boot("old")
    assert guests.templates.get("t2").build == 1
    asked = time.monotonic()
    _, skew = await guests.refresh("old")
    # How far the guest's clock was from the host's time in the request when the guest read it:
    # the call's transit (seconds under TCG on a loaded host) on top of the clock's error, which
    # is the template's age (>= 10 s) if the clone did not take the host's time.
    transit = time.monotonic() - asked
    assert -1e9 < skew < (transit + 1.0) * 1e9, (
        f"the clone's clock was {skew / 1e9:+.1f} s off ({transit:.1f} s call)"
    )

    # The image changes: the next clone rebuilds the template; the old clone keeps serving.
    with (image / "rootfs.img").open("ab") as rootfs:
        rootfs.write(b"\0" * 4096)
    await guests.allocate(clone_spec("new", "t2"))
    await guests.boot("new")
    rebuilt = guests.templates.get("t2")
    assert rebuilt.build == 2 and rebuilt.state == TemplateState.READY
    assert not (Path(rebuilt.run_dir) / "build-1").exists()
    assert vms.get("old").state == State.RUNNING and booted.record.template == "t2"
    boot_id, _ = await guests.refresh("old")  # the clone of the old build still answers
    new_id, _ = await guests.refresh("new")
    assert boot_id != new_id
    for name in ("old", "new"):
        await guests.free(name, 0.0)
    await guests.remove_template("t2")
    await guests.trust.close()


async def test_a_clone_has_the_guest_ready_timeout_to_take_its_identity_not_a_fixed_one(
    env: VmEnv, pki: PkiPaths, guest_image: Path
) -> None:
    """Taking its identity is part of a clone's getting ready: it has the guest_ready_timeout a
    booting guest has (20 clones at once on 2 cores took 9-37 s to take theirs; a fixed 30 s
    failed every one of them). Here the host's guests have FROZEN_READY_TIMEOUT and the clone's
    VMM is frozen (SIGSTOP) as soon as it is restored, as a host too busy to run it would leave
    it: the Start fails for the identity after that timeout, not after a deadline of its own."""
    vms, guests = guests_over(env, pki, guest_image)
    await guests.create_template("t3", vcpus=1, memory_mib=MEMORY_MIB)
    await vms.close()
    await guests.trust.close()

    vms, guests = guests_over(env, pki, guest_image, ready_timeout=FROZEN_READY_TIMEOUT)
    await guests.allocate(clone_spec("frozen", "t3"))
    restore = vms.start
    frozen: list[int] = []

    async def restore_then_freeze(name: str, **how: Any) -> tuple[VmRecord, float | None]:
        record, ready = await restore(name, **how)
        assert record.run is not None
        os.kill(record.run.pid, signal.SIGSTOP)
        frozen.append(record.run.pid)
        return record, ready

    vms.start = restore_then_freeze  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        with pytest.raises(AuraeError) as failed:
            async with asyncio.timeout(FROZEN_READY_TIMEOUT + 15):
                await guests.boot("frozen")
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - started
    assert failed.value.kind == ErrorKind.DEADLINE_EXCEEDED, failed.value
    assert f"did not take its identity within {FROZEN_READY_TIMEOUT:g} s" in failed.value.message
    assert frozen and took >= FROZEN_READY_TIMEOUT, took
    assert vms.get("frozen").state != State.RUNNING  # stopped, never served
    await guests.free("frozen", 0.0)
    await guests.remove_template("t3")
    await guests.trust.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    return ensure_dev_pki(tmp_path_factory.mktemp("tpl-pki"))
