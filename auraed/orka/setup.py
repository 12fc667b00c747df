"""Building the node agent from the daemon's configuration: its node id, workloads and agent."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from auraed.config import DaemonConfig
from auraed.orka.agent import AgentSettings, NodeAgent
from auraed.state.store import Store
from auraed.system.node import CpuLoad

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
        retries=config.orka_join_retries,
        exit_on_join_failure=config.orka_join_failure == "exit",
        status_interval=config.orka_status_interval,
        ca_crt=config.orka_scheduler_ca,
        server_name=config.orka_scheduler_server_name,
    )


def build_agent(
    config: DaemonConfig, store: Store, port: int, give_up: Callable[[str], None], cpu: CpuLoad
) -> NodeAgent:
    return NodeAgent(agent_settings(config, port), node_id(store), give_up, cpu)
