"""Building the VM subsystem from the daemon's configuration (the vm_* and *_binary settings)."""

from __future__ import annotations

import logging

from auraed.config import DaemonConfig
from auraed.state.store import Store
from auraed.system.kvm import KvmProbe, probe_kvm
from auraed.vms.backend import Backend
from auraed.vms.cloud_hypervisor import CloudHypervisorBackend
from auraed.vms.network import parse_pool
from auraed.vms.qemu import QemuBackend
from auraed.vms.vms import Vms

log = logging.getLogger(__name__)


def build(
    config: DaemonConfig,
    store: Store,
    *,
    kvm: KvmProbe | None = None,
) -> Vms:
    """The Vms domain object. ``kvm``: the daemon's KVM probe (probed here when not given).

    Call ``await vms.recover()`` once the event loop runs, before serving.
    """
    if kvm is None:
        kvm = probe_kvm()
    probe = kvm
    backends: dict[str, Backend] = {
        "qemu": QemuBackend(
            binary=config.qemu_binary,
            machine=config.vm_machine,
            kvm_usable=lambda: probe.usable,
            virtiofsd=config.virtiofsd_binary,
            max_vcpus=config.vm_max_vcpus,
            max_memory_mib=config.vm_max_memory_mib,
            memory_slots=config.vm_memory_slots,
            debug_console=config.vm_debug_console,
            tcg_cache_mib=config.vm_tcg_cache_mib,
        ),
        "cloud-hypervisor": CloudHypervisorBackend(
            binary=config.cloud_hypervisor_binary,
            kvm_usable=lambda: probe.usable,
            kvm_detail=lambda: probe.detail,
        ),
    }
    if config.vm_debug_console:
        log.warning("VMs: vm_debug_console is on: QEMU VMs, templates, clones get a debug shell (DebugShell)")
    log.info(
        "VMs: QEMU %s (%s), KVM %s, address pool %s",
        config.qemu_binary,
        config.vm_machine,
        "usable" if probe.usable else "not usable",
        config.vm_address_pool,
    )
    return Vms(
        store,
        backends,
        runtime_dir=config.runtime_dir,
        pool=parse_pool(config.vm_address_pool),
        guest_port=config.vm_guest_port,
        default_stop_timeout=config.stop_grace_period,
    )
