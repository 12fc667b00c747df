"""Running CNI plugins: one invocation (environment in, configuration on stdin, result or error on
stdout), and a network list's ADD, CHECK and DEL as libcni chains them.

- ADD runs the plugins in order; each after the first gets the previous one's result as
  ``prevResult``, and the last result is the list's.
- DEL runs them in reverse order; from 0.4.0 on, each gets the cached ADD result as
  ``prevResult`` (before that, none). Every plugin gets its DEL even when one failed (below).
- CHECK (0.4.0 on) runs them in order, each with the cached ADD result.

Each plugin's configuration is its object from the list with the list's ``name`` and
``cniVersion`` put in, and ``runtimeConfig`` holding those capability arguments the plugin
declares in its ``capabilities`` (libcni's injectRuntimeConfig; a plugin declaring none gets
no ``runtimeConfig``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from auraed.cni.config import NetworkConfigList, PluginConf, find_plugin
from auraed.cni.errors import CniError, kind_of_plugin_code
from auraed.cni.result import CniResult, parse_result

MAX_OUTPUT_BYTES = 1 << 20
"""A plugin's stdout beyond this is no result (1 MiB; real ones are under 2 KiB)."""
STDERR_TAIL_BYTES = 4096
"""How much of a failing plugin's stderr goes into the error."""
FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH for plugins when auraed has none: portmap and bridge run iptables from it."""
_READ_SIZE = 65536


@dataclasses.dataclass(frozen=True)
class RuntimeConf:
    """Everything of one invocation but the network configuration (libcni's RuntimeConf)."""

    container_id: str
    netns: str
    ifname: str
    args: tuple[tuple[str, str], ...] = ()
    capability_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def plugin_config(
    network: NetworkConfigList,
    plugin: PluginConf,
    prev_result: Mapping[str, Any] | None,
    capability_args: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON a plugin reads on stdin (see the module's docstring)."""
    config = dict(plugin.raw)
    config["name"] = network.name
    config["cniVersion"] = network.cni_version
    if prev_result is not None:
        config["prevResult"] = prev_result
    runtime = {key: value for key, value in capability_args.items() if key in plugin.capabilities}
    if runtime:
        config["runtimeConfig"] = runtime
    return config


def plugin_env(command: str, runtime: RuntimeConf, bin_dirs: tuple[Path, ...]) -> dict[str, str]:
    """auraed's environment, without any CNI_* of its own, and the invocation's CNI_* variables."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("CNI_")}
    env.setdefault("PATH", FALLBACK_PATH)
    env.update(
        CNI_COMMAND=command,
        CNI_CONTAINERID=runtime.container_id,
        CNI_NETNS=runtime.netns,
        CNI_IFNAME=runtime.ifname,
        CNI_ARGS=";".join(f"{key}={value}" for key, value in runtime.args),
        CNI_PATH=":".join(map(str, bin_dirs)),
    )
    return env


@dataclasses.dataclass(frozen=True)
class PluginOutput:
    returncode: int
    stdout: bytes
    stderr: bytes


async def _read_capped(stream: asyncio.StreamReader | None, limit: int, tail: bool) -> bytes:
    """What ``stream`` gives until EOF, keeping ``limit + 1`` bytes at most (the head, or with
    ``tail`` the end) and discarding the rest, so the plugin never blocks on a full pipe."""
    if stream is None:
        return b""
    kept = bytearray()
    while chunk := await stream.read(_READ_SIZE):
        kept += chunk
        if len(kept) > limit:
            if tail:
                del kept[: len(kept) - limit]
            else:
                del kept[limit + 1 :]
    return bytes(kept)


async def _feed(stream: asyncio.StreamWriter | None, data: bytes) -> None:
    if stream is None:
        return
    # A plugin may exit without reading all of its configuration (VERSION does): not our error.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.write(data)
        await stream.drain()
    stream.close()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the plugin and what it started in its session (iptables, say), then reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    await asyncio.shield(proc.wait())


async def exec_plugin(path: Path, stdin: bytes, env: Mapping[str, str], timeout: float) -> PluginOutput:
    """Run one plugin in a session of its own; on timeout or cancellation it is killed (with its
    session) and reaped before this returns or raises."""
    try:
        proc = await asyncio.create_subprocess_exec(
            str(path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            start_new_session=True,
        )
    except OSError as exc:
        raise CniError.precondition(f"cannot run CNI plugin {path}: {exc.strerror or exc}") from None
    try:
        async with asyncio.timeout(timeout):
            _, out, err = await asyncio.gather(
                _feed(proc.stdin, stdin),
                _read_capped(proc.stdout, MAX_OUTPUT_BYTES, tail=False),
                _read_capped(proc.stderr, STDERR_TAIL_BYTES, tail=True),
            )
            returncode = await proc.wait()
    except TimeoutError:
        await _kill(proc)
        raise CniError.deadline(f"CNI plugin {path} did not finish in {timeout:g}s") from None
    except BaseException:
        await _kill(proc)
        raise
    return PluginOutput(returncode, out, err)


def _stderr_text(stderr: bytes) -> str:
    return stderr.decode(errors="replace").strip()


def plugin_failure(what: str, output: PluginOutput) -> CniError:
    """The error for a plugin that exited non-zero: from its JSON error ``{code, msg, details}``
    when it wrote one, else from its stderr."""
    try:
        doc = json.loads(output.stdout)
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("code"), int) and not isinstance(doc["code"], bool):
        code = int(doc["code"])
        message = str(doc.get("msg") or "")
        details = str(doc.get("details") or "")
        text = ": ".join(part for part in (message, details) if part) or _stderr_text(output.stderr)
        return CniError(kind_of_plugin_code(code), f"{what} failed: {text} (CNI error code {code})")
    text = _stderr_text(output.stderr) or output.stdout.decode(errors="replace").strip()
    return CniError.internal(f"{what} failed with exit status {output.returncode}: {text or 'no output'}")


class PluginRunner:
    """Runs network lists' plugins found in ``bin_dirs``, each invocation within ``timeout``."""

    def __init__(self, bin_dirs: tuple[Path, ...], timeout: float) -> None:
        self.bin_dirs = bin_dirs
        self.timeout = timeout

    def plugin_path(self, network: NetworkConfigList, plugin: PluginConf) -> Path:
        path = find_plugin(plugin.type, self.bin_dirs)
        if path is None:
            dirs = ":".join(map(str, self.bin_dirs))
            raise CniError.precondition(
                f"CNI network {network.name}: plugin {plugin.type!r} not found in {dirs} "
                f"(from {network.source})"
            )
        return path

    async def invoke(
        self,
        command: str,
        network: NetworkConfigList,
        plugin: PluginConf,
        runtime: RuntimeConf,
        prev_result: Mapping[str, Any] | None,
    ) -> bytes:
        """One plugin's ``command``; its stdout when it succeeded."""
        path = self.plugin_path(network, plugin)
        config = plugin_config(network, plugin, prev_result, runtime.capability_args)
        env = plugin_env(command, runtime, self.bin_dirs)
        output = await exec_plugin(path, json.dumps(config).encode(), env, self.timeout)
        if output.returncode != 0:
            raise plugin_failure(f"CNI network {network.name}: plugin {plugin.type} {command}", output)
        if len(output.stdout) > MAX_OUTPUT_BYTES:
            raise CniError.internal(
                f"CNI plugin {plugin.type} {command} wrote more than {MAX_OUTPUT_BYTES} bytes"
            )
        return output.stdout

    def _result(self, network: NetworkConfigList, plugin: PluginConf, stdout: bytes) -> CniResult:
        try:
            return parse_result(json.loads(stdout), network.cni_version)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise CniError.internal(
                f"CNI network {network.name}: plugin {plugin.type} ADD gave no valid result: {exc}"
            ) from None

    async def add(self, network: NetworkConfigList, runtime: RuntimeConf) -> CniResult:
        result: CniResult | None = None
        for plugin in network.plugins:
            prev = None if result is None else result.raw
            stdout = await self.invoke("ADD", network, plugin, runtime, prev)
            result = self._result(network, plugin, stdout)
        assert result is not None  # a list has at least one plugin
        return result

    async def check(
        self, network: NetworkConfigList, runtime: RuntimeConf, cached: Mapping[str, Any]
    ) -> None:
        if not network.supports_check:
            raise CniError.precondition(
                f"CNI network {network.name}: configuration version {network.cni_version} does not "
                "support the CHECK command"
            )
        if network.disable_check:
            return
        for plugin in network.plugins:
            await self.invoke("CHECK", network, plugin, runtime, cached)

    async def delete(
        self, network: NetworkConfigList, runtime: RuntimeConf, cached: Mapping[str, Any] | None
    ) -> None:
        """DEL through every plugin, last first; ``cached`` (the ADD result, if any) is passed on
        only where the version asks for it.

        Unlike libcni, a plugin that fails does not stop the others: the bridge's veth and
        host-local's address are still released when portmap cannot run. The first failure is
        raised at the end (naming how many failed); DEL is idempotent by the spec, so the retry
        that follows may repeat the DELs that succeeded.
        """
        prev = cached if network.deletes_with_result else None
        failures: list[CniError] = []
        for plugin in reversed(network.plugins):
            try:
                await self.invoke("DEL", network, plugin, runtime, prev)
            except CniError as exc:
                failures.append(exc)
        if failures:
            first = failures[0]
            more = f" (and {len(failures) - 1} more plugins failed)" if len(failures) > 1 else ""
            raise CniError(first.kind, first.message + more)
