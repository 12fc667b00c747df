"""Pod networks through CNI: a pod sandbox's network attached (ADD), checked (CHECK) and detached
(DEL), each attachment recorded in the state store as libcni's cache dir records it.

The record (kind ``cni_attachment``, key ``<sandbox id>/<ifname>``) holds the network list ADD
ran with, the pod's CNI_ARGS and capability arguments, and, once ADD succeeded, its result. It
is written before the first plugin runs (state ``adding``), so a DEL after a crash, by a new
auraed, runs with exactly that configuration and result, whatever the conf dir holds by then.
A failed or cancelled ADD is undone at once by a DEL (without a result, as after any failed
ADD), so nothing stays allocated; the record goes only once a DEL succeeded.

ADD, CHECK and DEL of one attachment never overlap, and each runs to its end when its caller
leaves: a plugin cut short would leave an allocation no record describes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from auraed.cni.config import ConfDir, NetworkConfigList, load_conf_dir, missing_plugins, parse_config_list
from auraed.cni.errors import CniError
from auraed.cni.invoke import PluginRunner, RuntimeConf
from auraed.cni.model import DEFAULT_IFNAME, CniSettings, PodNetwork
from auraed.cni.result import CniResult, parse_result
from auraed.state.store import Store
from auraed.system.tasks import run_to_end

log = logging.getLogger(__name__)

KIND = "cni_attachment"
ADDING = "adding"
ADDED = "added"
NOT_READY_REASON = "NetworkPluginNotReady"
"""The CRI's NetworkReady reason when it is false (what kubelets and containerd use)."""


@dataclasses.dataclass(frozen=True)
class NetworkStatus:
    """Whether pods can get a network: a valid default network whose plugins are all there.
    ``reason`` and ``message`` say why not (empty when ready)."""

    ready: bool
    reason: str = ""
    message: str = ""
    network: str = ""  # the default network's name, when there is one


@dataclasses.dataclass(frozen=True)
class Attachment:
    """One pod interface attached to a network, as recorded."""

    sandbox_id: str
    ifname: str
    netns: str
    network: NetworkConfigList
    cni_args: tuple[tuple[str, str], ...]
    capability_args: dict[str, Any]
    state: str
    result: CniResult | None = None

    @property
    def key(self) -> str:
        return attachment_key(self.sandbox_id, self.ifname)

    @property
    def pod_ips(self) -> list[str]:
        """The pod's addresses on its interface, IPv4 first; none until ADD succeeded."""
        return [] if self.result is None else self.result.pod_ips(self.ifname)

    @property
    def runtime(self) -> RuntimeConf:
        return RuntimeConf(self.sandbox_id, self.netns, self.ifname, self.cni_args, self.capability_args)

    def to_doc(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "ifname": self.ifname,
            "netns": self.netns,
            "config": dict(self.network.raw),
            "config_source": self.network.source,
            "cni_args": [list(pair) for pair in self.cni_args],
            "capability_args": self.capability_args,
            "state": self.state,
            "result": None if self.result is None else dict(self.result.raw),
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Attachment:
        network = parse_config_list(doc["config"], doc["config_source"])
        raw_result = doc["result"]
        return cls(
            sandbox_id=doc["sandbox_id"],
            ifname=doc["ifname"],
            netns=doc["netns"],
            network=network,
            cni_args=tuple((str(k), str(v)) for k, v in doc["cni_args"]),
            capability_args=dict(doc["capability_args"]),
            state=doc["state"],
            result=None if raw_result is None else parse_result(raw_result, network.cni_version),
        )


def attachment_key(sandbox_id: str, ifname: str) -> str:
    return f"{sandbox_id}/{ifname}"


class Cni:
    """Pod networking for one daemon: networks from ``settings.conf_dir``, plugins from
    ``settings.bin_dirs``, attachments in ``store``."""

    def __init__(self, store: Store, settings: CniSettings | None = None) -> None:
        self.settings = settings or CniSettings()
        self._store = store
        self._runner = PluginRunner(self.settings.bin_dirs, self.settings.plugin_timeout)
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> its lock, how many use it

    # -- networks --------------------------------------------------------------------------

    def networks(self) -> ConfDir:
        """The conf dir as it is now (read at each call: an operator's new file counts at once)."""
        return load_conf_dir(self.settings.conf_dir)

    def status(self) -> NetworkStatus:
        """For the CRI's NetworkReady: is there a valid default network, are its plugins there?"""
        try:
            network = self._default(self.networks())
        except CniError as exc:
            return NetworkStatus(False, NOT_READY_REASON, exc.message)
        missing = missing_plugins(network, self.settings.bin_dirs)
        if missing:
            dirs = ":".join(map(str, self.settings.bin_dirs))
            return NetworkStatus(
                False,
                NOT_READY_REASON,
                f"CNI network {network.name} ({network.source}): "
                f"plugin {', '.join(missing)} not found in {dirs}",
                network.name,
            )
        return NetworkStatus(True, network=network.name)

    def default_network(self) -> NetworkConfigList:
        """The first valid network of the conf dir; FAILED_PRECONDITION saying why there is none."""
        return self._default(self.networks())

    def _default(self, conf: ConfDir) -> NetworkConfigList:
        if conf.default is not None:
            return conf.default
        if not conf.skipped:
            raise CniError.precondition(f"no CNI network config found in {conf.directory}")
        reasons = "; ".join(skip.reason for skip in conf.skipped)
        raise CniError.precondition(f"no valid CNI network config in {conf.directory}: {reasons}")

    # -- attachments -----------------------------------------------------------------------

    def attachment(self, sandbox_id: str, ifname: str = DEFAULT_IFNAME) -> Attachment | None:
        doc = self._store.get(KIND, attachment_key(sandbox_id, ifname))
        if doc is None:
            return None
        try:
            return Attachment.from_doc(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise CniError.internal(
                f"the network record of sandbox {sandbox_id} ({ifname}) cannot be read: {exc}"
            ) from None

    def attachments(self) -> list[Attachment]:
        """Every recorded attachment (for recovery: the pods gone meanwhile are detached)."""
        return self._store.load(KIND, Attachment.from_doc)

    @contextlib.asynccontextmanager
    async def _exclusive(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def attach(self, pod: PodNetwork, network: NetworkConfigList | None = None) -> Attachment:
        """ADD the pod to ``network`` (the default network when None); the attachment with its
        result. ALREADY_EXISTS when the pod's interface is attached already."""
        network = network or self.default_network()
        for plugin in network.plugins:  # all there before any runs: nothing to undo then
            self._runner.plugin_path(network, plugin)
        record = Attachment(
            pod.sandbox_id, pod.ifname, pod.netns, network, pod.cni_args(), pod.capability_args(), ADDING
        )
        async with self._exclusive(record.key):
            if self._store.get(KIND, record.key) is not None:
                raise CniError.already_exists(f"network interface {pod.ifname} of sandbox {pod.sandbox_id}")
            self._store.put(KIND, record.key, record.to_doc())
            try:
                result = await run_to_end(self._runner.add(network, record.runtime))
            except BaseException as exc:
                await run_to_end(self._undo(record, exc))
                raise
            added = dataclasses.replace(record, state=ADDED, result=result)
            self._store.put(KIND, added.key, added.to_doc())
        log.info("attached sandbox %s (%s) to CNI network %s: %s", pod.sandbox_id, pod.ifname, network.name,
                 ", ".join(added.pod_ips) or "no address")  # fmt: skip
        return added

    async def _undo(self, record: Attachment, cause: BaseException) -> None:
        try:
            await self._runner.delete(record.network, record.runtime, None)
        except Exception as exc:
            # The record stays (state adding): the CRI's DEL at Stop/Remove, or recovery, retries.
            log.warning("could not undo the failed ADD of sandbox %s (%s): %s (ADD: %s)",
                        record.sandbox_id, record.ifname, exc, cause)  # fmt: skip
            return
        self._store.delete(KIND, record.key)

    async def check(self, sandbox_id: str, ifname: str = DEFAULT_IFNAME) -> None:
        """CHECK the attachment with its cached result: nothing raised means the plugins found
        it as ADD left it. NOT_FOUND without an attachment; FAILED_PRECONDITION when its
        version has no CHECK or its ADD did not complete."""
        async with self._exclusive(attachment_key(sandbox_id, ifname)):
            record = self.attachment(sandbox_id, ifname)
            if record is None:
                raise CniError.not_found(f"network interface {ifname} of sandbox {sandbox_id}")
            if record.result is None:
                raise CniError.precondition(
                    f"network interface {ifname} of sandbox {sandbox_id}: its ADD did not complete"
                )
            await run_to_end(self._runner.check(record.network, record.runtime, record.result.raw))

    async def detach(self, sandbox_id: str, ifname: str = DEFAULT_IFNAME) -> bool:
        """DEL the attachment with the configuration and result ADD recorded, then forget it.
        False when there is none (never attached, or detached already): detaching is idempotent,
        as the CRI's StopPodSandbox must be. A failing DEL keeps the record for the next try."""
        async with self._exclusive(attachment_key(sandbox_id, ifname)):
            record = self.attachment(sandbox_id, ifname)
            if record is None:
                return False
            cached = None if record.result is None else record.result.raw
            await run_to_end(self._runner.delete(record.network, record.runtime, cached))
            self._store.delete(KIND, record.key)
        log.info("detached sandbox %s (%s) from CNI network %s", sandbox_id, ifname, record.network.name)
        return True
