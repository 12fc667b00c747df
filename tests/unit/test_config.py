"""auraed.config: where each setting comes from, and how relative paths in the file are read; and
the client's config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from auraed.client.client import DEFAULT_KEEPALIVE_TIME, ClientError, load_client_config
from auraed.config import load_config
from auraed.errors import ConfigError


def write_config(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "auraed.toml"
    path.write_text(text)
    return path


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    config_file = write_config(
        tmp_path, 'cgroup_base = "from-file"\nlog_level = "DEBUG"\nstop_grace_period = 3\n'
    )
    environ = {"AURAED_CGROUP_BASE": "from-env", "AURAED_STOP_GRACE_PERIOD": "4"}
    config = load_config(["--config", str(config_file), "--stop-grace-period", "5"], environ)
    assert (config.cgroup_base, config.log_level, config.stop_grace_period) == ("from-env", "DEBUG", 5.0)
    assert config.config_file == config_file


def test_relative_paths_in_the_file_are_beside_it(tmp_path: Path) -> None:
    config_file = write_config(
        tmp_path / "etc",
        'ca_crt = "pki/ca.crt"\n'
        'state_dir = "/var/lib/elsewhere"\n'
        '[registries."registry.internal:5000"]\n'
        'ca_file = "pki/registry.pem"\n',
    )
    (tmp_path / "etc" / "pki").mkdir()
    (tmp_path / "etc" / "pki" / "registry.pem").write_text("")
    config = load_config(["--config", str(config_file), "--server-crt", "here/server.crt"], {})
    assert config.ca_crt == tmp_path / "etc" / "pki" / "ca.crt"
    assert config.state_dir == Path("/var/lib/elsewhere")  # absolute: as written
    assert config.registries["registry.internal:5000"].ca_file == str(
        tmp_path / "etc" / "pki" / "registry.pem"
    )
    assert config.server_crt == Path("here/server.crt")  # a flag: relative to where it is given


def test_a_relative_config_file_still_puts_its_paths_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(tmp_path / "conf", 'ca_crt = "ca.crt"\n')
    monkeypatch.chdir(tmp_path)
    config = load_config(["--config", "conf/auraed.toml"], {})
    assert config.ca_crt == tmp_path / "conf" / "ca.crt"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no_such_setting = 1\n", "unknown setting 'no_such_setting'"),
        ('free_cells_on_shutdown = "maybe"\n', "free_cells_on_shutdown: not a boolean"),
        ('[registries."r"]\nca_file = 3\n', "ca_file a path"),
        ('[registries."r"]\nca_file = "missing.pem"\n', "missing.pem does not exist"),
        ('[registries."https://registry.k8s.io"]\n', "not a URL"),
        ('[registries."r_1"]\n', "not a valid registry host"),
        ('[registries."docker.io"]\n[registries."Index.Docker.io"]\n', "docker.io is configured twice"),
        ('[registries."r"]\nmirrors = ["ftp://m"]\n', "must be an http:// or https:// URL"),
        ('[registries."r"]\nmirrors = ["http://"]\n', "names no host"),
        ('[registries."r"]\nmirrors = ["https://u:secret@m"]\n', "must not carry credentials"),
        ('[registries."r"]\nmirrors = ["http://m:99999"]\n', "bad port"),
        ("not toml [\n", "auraed.toml"),
    ],
)
def test_bad_files_are_refused_with_where_and_why(tmp_path: Path, text: str, message: str) -> None:
    config_file = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(config_file)], {})
    assert message in str(error.value) and str(config_file) in str(error.value)


def test_registry_hosts_are_keyed_as_lookups_spell_them(tmp_path: Path) -> None:
    """Host names are case-insensitive and index.docker.io is docker.io: a table for either
    spelling applies to the references that name it (the client looks up lowercase names)."""
    config_file = write_config(
        tmp_path,
        '[registries."Index.Docker.io"]\nmirrors = ["mirror.example:5000"]\n'
        '[registries."Registry.Example:5000"]\ninsecure = true\n',
    )
    config = load_config(["--config", str(config_file)], {})
    assert set(config.registries) == {"docker.io", "registry.example:5000"}
    assert config.registries["docker.io"].mirrors == ("mirror.example:5000",)


def test_values_are_checked_whatever_their_source(tmp_path: Path) -> None:
    empty = ["--config", str(write_config(tmp_path, ""))]
    for grace in ("-1", "601"):
        with pytest.raises(ConfigError, match="stop_grace_period: must be 0 to 600 seconds"):
            load_config([*empty, "--stop-grace-period", grace], {})
    with pytest.raises(ConfigError, match="AURAED_LOG_BUFFER_LINES: log_buffer_lines"):
        load_config(empty, {"AURAED_LOG_BUFFER_LINES": "many"})
    with pytest.raises(ConfigError, match="keepalive_time: must not be negative"):
        load_config([*empty, "--keepalive-time", "-1"], {})
    with pytest.raises(ConfigError, match="keepalive_timeout: must be positive"):
        load_config(empty, {"AURAED_KEEPALIVE_TIMEOUT": "0"})


def test_the_client_config_reads_keepalive_and_refuses_nonsense(tmp_path: Path) -> None:
    text = '[auth]\nca_crt = "ca.crt"\nclient_crt = "c.crt"\nclient_key = "c.key"\n[system]\n'
    (tmp_path / "default").write_text(text)
    assert load_client_config(tmp_path / "default").keepalive_time == DEFAULT_KEEPALIVE_TIME
    (tmp_path / "set").write_text(text + "keepalive_time = 0\nkeepalive_timeout = 2.5\n")
    config = load_client_config(tmp_path / "set")
    assert (config.keepalive_time, config.keepalive_timeout) == (0.0, 2.5)
    for bad in ("keepalive_time = -1", 'keepalive_time = "soon"', "keepalive_timeout = 0"):
        (tmp_path / "bad").write_text(text + bad + "\n")
        with pytest.raises(ClientError, match=r"\[system\] keepalive_time"):
            load_client_config(tmp_path / "bad")
