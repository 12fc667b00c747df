"""Building the node agent from the daemon's configuration: its node id, workloads and agent."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from auraed.config import DaemonConfig
from auraed.errors import ConfigError
from auraed.orka.agent import AgentSettings, NodeAgent
from auraed.orka.host import HostRunner
from auraed.orka.model import HOST, VM, Runner
from auraed.orka.workloads import Workloads
from auraed.state.store import Store
from auraed.system.node import CpuLoad

if TYPE_CHECKING:
    from auraed.containers.containers import Containers
    from auraed.images.images import Images
    from auraed.vms.guests import Guests

NODE_KIND = "orka_node"
NODE_KEY = "self"


def node_id(store: Store) -> str:
    """This node's id for orka: made once, then kept in the state store for every later start."""
    doc = store.get(NODE_KIND, NODE_KEY)
    if doc is not None and isinstance(doc.get("id"), str) and doc["id"]:
        return str(doc["id"])
    made = str(uuid.uuid4())
    store.put(NODE_KIND, NODE_KEY, {"id": made})
    return made


def agent_settings(config: DaemonConfig, port: int) -> AgentSettings:
    return AgentSettings(
        scheduler=config.orka_scheduler,
        port=port,
        retry_interval=config.orka_join_retry_interval,
        join_attempts=config.orka_join_attempts,
        exit_on_join_failure=config.orka_join_failure == "exit",
        status_interval=config.orka_status_interval,
        ca_crt=config.orka_scheduler_ca,
        server_name=config.orka_scheduler_server_name,
    )


def build_agent(
    config: DaemonConfig, store: Store, port: int, give_up: Callable[[str], None], cpu: CpuLoad
) -> NodeAgent:
    return NodeAgent(agent_settings(config, port), node_id(store), give_up, cpu)


async def build_workloads(
    config: DaemonConfig, store: Store, images: Images, containers: Containers, guests: Guests | None
) -> Workloads:
    """The workloads, their earlier runs' recovered. A guest VM per workload needs guests (the
    host role's), refused at start otherwise; workloads of earlier runs in VMs are served
    whenever guests are there, whatever the isolation of new ones."""
    runners: dict[str, Runner] = {HOST: HostRunner(containers)}
    if guests is not None:
        from auraed.orka.guest import GuestRunner, GuestSizing
        from auraed.vms.placement import ImagePlacer

        sizing = GuestSizing(config.orka_vm_vcpus, config.orka_vm_memory_mib)
        runners[VM] = GuestRunner(guests, images, ImagePlacer(images), sizing, config.stop_grace_period)
    elif config.orka_workload_isolation == VM:
        raise ConfigError("orka_workload_isolation: vm needs guest VMs, which only a host auraed boots")
    workloads = Workloads(store, images, runners, config.orka_workload_isolation)
    await workloads.recover()
    return workloads
