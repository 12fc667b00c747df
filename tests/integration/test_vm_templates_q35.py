"""Templates and clones on QEMU's q35 machine (test_vm_templates.py has microvm's), for real:
QEMU under TCG, the guest image's auraed, real taps. One template is made for the module (its
clones reuse it); each test starts its clones from it and frees them.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from auraed.pki import PkiPaths, ensure_dev_pki
from auraed.vms.guests import Guests
from auraed.vms.qemu import HOTPLUG_PORT
from auraed.vms.templates import TemplateRecord, TemplateState
from auraed.vms.vms import Vms
from tests.integration.test_vm_templates import clone_spec, guests_over, peer_certificate, run_in_guest
from tests.integration.test_vms import VmEnv

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TEMPLATE = "q35"


class Q35:
    def __init__(self, env: VmEnv, vms: Vms, guests: Guests, template: TemplateRecord) -> None:
        self.env, self.vms, self.guests, self.template = env, vms, guests, template


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    return ensure_dev_pki(tmp_path_factory.mktemp("q35-pki"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def q35(guest_image: Path, pki: PkiPaths) -> AsyncIterator[Q35]:
    root = Path(tempfile.mkdtemp(prefix="aurae-q35-", dir="/tmp"))  # unix socket paths are short
    env = VmEnv(root, guest_image, machine="q35")
    try:
        vms, guests = guests_over(env, pki, guest_image)
        template = await guests.create_template(TEMPLATE, vcpus=1, memory_mib=384)
        yield Q35(env, vms, guests, template)
        await guests.remove_template(TEMPLATE)
        await guests.trust.close()
    finally:
        await env.cleanup()


async def test_a_q35_template_s_clone_serves_with_its_own_identity(q35: Q35, pki: PkiPaths) -> None:
    template = q35.template
    assert (template.state, template.machine) == (TemplateState.READY, "q35")
    guests, vms = q35.guests, q35.vms
    await guests.allocate(clone_spec("q1", TEMPLATE))
    booted = await guests.boot("q1")
    assert booted.record.template == TEMPLATE and booted.record.run is not None
    assert booted.record.run.machine == "q35"
    assert booted.record.restore_ms is not None and booted.record.restore_ms < 1000, booted.record.restore_ms
    # The template's free root port, where a clone's virtio-fs is plugged (none is yet).
    handle = vms.handle("q1")
    assert handle is not None
    buses = await vms.backends["qemu"].query(handle, "query-pci")  # type: ignore[attr-defined]
    ports = [d for bus in buses for d in bus["devices"] if d.get("qdev_id") == HOTPLUG_PORT]
    assert len(ports) == 1 and ports[0]["pci_bridge"]["devices"] == [], ports
    address = vms.address(vms.get("q1"))
    cert = await asyncio.to_thread(peer_certificate, q35.env, pki, address, "q1")
    assert cert.subject.rfc4514_string()
    (hostname,) = await run_in_guest(guests, "q1", "hostname")
    assert hostname == "q1"
    await guests.free("q1", 0.0)
    assert guests.template_users(TEMPLATE) == []
