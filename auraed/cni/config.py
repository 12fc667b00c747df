"""Network configurations from a conf dir, read as libcni reads them, and plugin binaries found
in bin dirs.

Files ending in ``.conf``, ``.conflist`` or ``.json`` are read in lexical order of their names;
the first valid one is the default network (containerd and CRI-O pick it the same way). A
``.conflist`` holds a network list (``name``, ``cniVersion``, ``plugins``); a ``.conf`` or
``.json`` holds one plugin's configuration, which is wrapped into a list of one, as libcni's
ConfListFromConf does. A file that cannot be used is skipped with the reason, so that one broken
file does not take the node's network down while a valid one follows it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0")
"""The spec versions whose results and chaining this package speaks: network lists came with
0.3.0, CHECK and the cached result on DEL with 0.4.0. 0.1/0.2 results have another shape."""

CHECK_VERSION = "0.4.0"
"""The first version with CHECK, and with the cached result passed to DEL (libcni's rule)."""

CONF_EXTENSIONS = (".conf", ".conflist", ".json")
LIST_EXTENSION = ".conflist"
MAX_CONF_BYTES = 1 << 20
"""A configuration file bigger than this is not one (1 MiB; real ones are under 2 KiB)."""

# libcni's utils.ValidateNetworkName (and the spec's rule for a network's name).
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def at_least(version: str, minimum: str) -> bool:
    return version_tuple(version) >= version_tuple(minimum)


@dataclasses.dataclass(frozen=True)
class PluginConf:
    """One plugin of a network list: its ``type`` (the binary's name), the capabilities it
    declares (``"capabilities": {"portMappings": true}``) and its object as written."""

    type: str
    capabilities: frozenset[str]
    raw: Mapping[str, Any] = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class NetworkConfigList:
    """A network list as loaded: ``raw`` is the list form (a .conf already wrapped), which is what
    an attachment's record keeps so that DEL runs with the configuration ADD ran with."""

    name: str
    cni_version: str
    plugins: tuple[PluginConf, ...]
    disable_check: bool
    source: str
    raw: Mapping[str, Any] = dataclasses.field(compare=False)

    @property
    def supports_check(self) -> bool:
        return at_least(self.cni_version, CHECK_VERSION)

    @property
    def deletes_with_result(self) -> bool:
        """Whether DEL gets the cached ADD result as ``prevResult`` (0.4.0 and later)."""
        return at_least(self.cni_version, CHECK_VERSION)


@dataclasses.dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ConfDir:
    """What a conf dir holds: its valid networks in order (the first is the default) and the
    files skipped, each with why."""

    directory: str
    networks: tuple[NetworkConfigList, ...]
    skipped: tuple[SkippedFile, ...]

    @property
    def default(self) -> NetworkConfigList | None:
        return self.networks[0] if self.networks else None


def _string(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {key!r} must be a non-empty string")
    return value


def _version(doc: Mapping[str, Any], where: str) -> str:
    version = _string(doc, "cniVersion", where)
    if version not in SUPPORTED_VERSIONS:
        spoken = ", ".join(SUPPORTED_VERSIONS)
        raise ValueError(f"{where}: cniVersion {version!r} is not supported (auraed speaks {spoken})")
    return version


def _name(doc: Mapping[str, Any], where: str) -> str:
    name = _string(doc, "name", where)
    if not _NAME.match(name):
        raise ValueError(f"{where}: name {name!r} must be letters, digits, '_', '.' and '-' (not first)")
    return name


def _plugin(doc: Any, where: str) -> PluginConf:
    if not isinstance(doc, dict):
        raise ValueError(f"{where} must be an object")
    plugin_type = _string(doc, "type", where)
    if "/" in plugin_type or plugin_type in (".", ".."):
        raise ValueError(f"{where}: type {plugin_type!r} must be a plugin's file name, not a path")
    capabilities = doc.get("capabilities", {})
    if not isinstance(capabilities, dict) or not all(isinstance(v, bool) for v in capabilities.values()):
        raise ValueError(f"{where}: capabilities must be an object of booleans")
    return PluginConf(plugin_type, frozenset(k for k, on in capabilities.items() if on), doc)


def _disable_check(doc: Mapping[str, Any], where: str) -> bool:
    value = doc.get("disableCheck", False)
    # libcni also takes the words, as strconv.ParseBool reads them.
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "t", "f"):
        return value.lower() in ("true", "1", "t")
    if not isinstance(value, bool):
        raise ValueError(f"{where}: disableCheck must be a boolean")
    return value


def parse_config_list(doc: Any, source: str) -> NetworkConfigList:
    """A network list from its JSON object; ValueError naming the problem if it is not one."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a network list must be a JSON object")
    version = _version(doc, source)
    name = _name(doc, source)
    plugins = doc.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise ValueError(f"{source}: 'plugins' must be a non-empty list")
    parsed = tuple(_plugin(p, f"{source}: plugins[{i}]") for i, p in enumerate(plugins))
    return NetworkConfigList(name, version, parsed, _disable_check(doc, source), source, doc)


def wrap_plugin_config(doc: Any, source: str) -> NetworkConfigList:
    """A single plugin's configuration (a .conf file) as a network list of one."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a network configuration must be a JSON object")
    if "type" not in doc and "plugins" in doc:
        raise ValueError(f"{source}: has 'plugins' but no 'type': a network list belongs in a .conflist file")
    version = _version(doc, source)
    name = _name(doc, source)
    _plugin(doc, source)
    return parse_config_list({"cniVersion": version, "name": name, "plugins": [doc]}, source)


def read_config_file(path: Path) -> NetworkConfigList:
    """One file of a conf dir; ValueError with the reason it cannot be used."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if info.st_size > MAX_CONF_BYTES:
            raise ValueError(f"{path}: {info.st_size} bytes is too big for a network configuration")
        text = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    if path.suffix == LIST_EXTENSION:
        return parse_config_list(doc, str(path))
    return wrap_plugin_config(doc, str(path))


def load_conf_dir(directory: Path) -> ConfDir:
    """Every configuration file of ``directory`` (see the module's docstring). A missing
    directory holds none."""
    try:
        names = sorted(entry.name for entry in os.scandir(directory) if entry.name.endswith(CONF_EXTENSIONS))
    except FileNotFoundError:
        names = []
    except OSError as exc:
        return ConfDir(str(directory), (), (SkippedFile(str(directory), exc.strerror or str(exc)),))
    networks, skipped = [], []
    for name in names:
        path = directory / name
        try:
            networks.append(read_config_file(path))
        except ValueError as exc:
            skipped.append(SkippedFile(str(path), str(exc)))
    return ConfDir(str(directory), tuple(networks), tuple(skipped))


def find_plugin(plugin_type: str, bin_dirs: Iterable[Path]) -> Path | None:
    """The first executable regular file named ``plugin_type`` in ``bin_dirs`` (libcni's
    FindInPath), None when there is none."""
    for directory in bin_dirs:
        candidate = directory / plugin_type
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def missing_plugins(network: NetworkConfigList, bin_dirs: Iterable[Path]) -> list[str]:
    dirs = tuple(bin_dirs)
    return [p.type for p in network.plugins if find_plugin(p.type, dirs) is None]
