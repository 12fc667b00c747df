"""auraed.config: where each setting comes from, and how relative paths in the file are read; and
the client's config file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from auraed.client.client import ClientError, load_client_config
from auraed.config import load_config
from auraed.errors import ConfigError
from auraed.wire.channel import DEFAULT_KEEPALIVE_TIME


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
    for size in ("-1", "2049"):
        with pytest.raises(ConfigError, match=r"vm_tcg_cache_mib: must be 0 \(QEMU's own size\) to 2048"):
            load_config([*empty, "--vm-tcg-cache-mib", size], {})
    assert load_config([*empty, "--vm-tcg-cache-mib", "64"], {}).vm_tcg_cache_mib == 64


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


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:70000",
        "127.0.0.1:-1",
        "127.0.0.1:",
        "[::1]:65536",
        "::1:8080",
        "[nope]:80",
        ":8080",
        "h_1:80",
    ],
)
def test_a_malformed_tcp_listen_address_is_refused(address: str) -> None:
    """grpc would listen on port 70000 % 65536, 65535 for -1, 443 for none."""
    with pytest.raises(ConfigError, match="tcp_listen"):
        load_config(["--config", "/dev/null", "--tcp-listen", address], {})


@pytest.mark.parametrize("address", ["127.0.0.1:8080", "[::1]:1", "localhost:65535", "0.0.0.0:443"])
def test_tcp_listen_addresses_that_are_fine(address: str) -> None:
    assert load_config(["--config", "/dev/null", "--tcp-listen", address], {}).tcp_listen == address


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keepalive_time = nan\n", "keepalive_time: must be a finite number"),
        ("keepalive_timeout = inf\n", "keepalive_timeout: must be a finite number"),
        ("guest_ready_timeout = -nan\n", "guest_ready_timeout: must be a finite number"),
        ("log_buffer_lines = inf\n", "log_buffer_lines: must be an integer"),
        ("log_buffer_lines = 2.5\n", "log_buffer_lines: must be an integer"),
        ("socket = 5\n", "socket: must be a path"),
        ("state_dir = { a = 1 }\n", "state_dir: must be a path"),
        ("role = 1\n", "role: must be a string"),
        ("nested = 1\n", "nested: must be a boolean"),
        ("stop_grace_period = [1]\n", "stop_grace_period: must be a number"),
        ("stop_executables_on_shutdown = 2024-01-01\n", "stop_executables_on_shutdown: must be a boolean"),
    ],
)
def test_values_of_the_wrong_type_or_not_finite_are_refused_naming_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    config_file = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(config_file)], {})
    assert message in str(error.value) and str(config_file) in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("log_buffer_lines = 1000000000000\n", "log_buffer_lines: must be 1 to"),
        ("vm_guest_port = 99999\n", "vm_guest_port: must be a port"),
        ("keepalive_time = 1e300\n", "keepalive_time: must be at most"),
        ("guest_ready_timeout = 0\n", "guest_ready_timeout: must be more than 0"),
        ("guest_keepalive_time = 4\n", "guest_keepalive_time: must be 5 to 86400 seconds"),
        ("guest_keepalive_timeout = 0\n", "guest_keepalive_timeout: must be more than 0"),
        ('cri_streaming_address = "0.0.0.0"\n', "cri_streaming_address: 0.0.0.0 is not a loopback"),
        ('cri_streaming_address = "192.0.2.2"\n', "cri_streaming_address: 192.0.2.2 is not a loopback"),
        ('cri_streaming_address = "localhost"\n', "cri_streaming_address: 'localhost' is not an IP"),
        ("cri_streaming_port = 65536\n", "cri_streaming_port: must be 0 to 65535"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", str(write_config(tmp_path, text))], {})


def test_the_streaming_server_listens_on_loopback_by_default_and_where_asked() -> None:
    config = load_config(["--config", "/dev/null"], {})
    assert (config.cri_streaming_address, config.cri_streaming_port) == ("127.0.0.1", 0)
    flags = ["--config", "/dev/null", "--cri-streaming-address", "::1", "--cri-streaming-port", "10010"]
    config = load_config(flags, {})
    assert (config.cri_streaming_address, config.cri_streaming_port) == ("::1", 10010)


def test_text_that_is_not_utf8_is_refused_naming_where(tmp_path: Path) -> None:
    config_file = tmp_path / "auraed.toml"
    config_file.write_bytes(b'log_level = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(["--config", str(config_file)], {})
    undecodable = b"base\xff".decode(errors="surrogateescape")  # as os.environ and sys.argv have it
    with pytest.raises(ConfigError, match="AURAED_CGROUP_BASE: cgroup_base: not valid UTF-8"):
        load_config(["--config", "/dev/null"], {"AURAED_CGROUP_BASE": undecodable})
    with pytest.raises(ConfigError, match="--stop-grace-period: stop_grace_period: not valid UTF-8"):
        load_config(["--config", "/dev/null", "--stop-grace-period", "nan\udcff"], {})
    for number in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match="AURAED_KEEPALIVE_TIME: keepalive_time: must be a finite"):
            load_config(["--config", "/dev/null"], {"AURAED_KEEPALIVE_TIME": number})


def test_a_nonsense_daemon_config_ends_without_a_traceback(tmp_path: Path) -> None:
    config_file = write_config(tmp_path, "log_buffer_lines = inf\n")
    result = subprocess.run(
        [sys.executable, "-m", "auraed", "--config", str(config_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "log_buffer_lines" in result.stderr


CLIENT_AUTH = '[auth]\nca_crt = "ca.crt"\nclient_crt = "c.crt"\nclient_key = "c.key"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('auth = "everything"\n', "[auth] must be a table"),
        (
            "[auth]\nca_crt = 5\nclient_crt = 'c'\nclient_key = 'k'\n",
            "[auth] ca_crt must be a non-empty string",
        ),
        (
            "[auth]\nca_crt = ''\nclient_crt = 'c'\nclient_key = 'k'\n",
            "[auth] ca_crt must be a non-empty string",
        ),
        ("[auth]\nclient_crt = 'c'\nclient_key = 'k'\n", "missing [auth] ca_crt"),
        ("system = [1]\n" + CLIENT_AUTH, "[system] must be a table"),
        (CLIENT_AUTH + "[system]\nserver_name = 5\n", "[system] server_name must be a non-empty string"),
        (CLIENT_AUTH + "[system]\nsocket = true\n", "[system] socket must be a non-empty string"),
        (CLIENT_AUTH + "[system]\naddress = { a = 1 }\n", "[system] address must be a non-empty string"),
        (CLIENT_AUTH + "[system]\nkeepalive_time = nan\n", "[system] keepalive_time must be seconds"),
        (CLIENT_AUTH + "[system]\nkeepalive_timeout = inf\n", "[system] keepalive_timeout must be seconds"),
    ],
)
def test_odd_client_configs_are_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config").write_text(text)
    with pytest.raises(ClientError) as error:
        load_client_config(tmp_path / "config")
    assert message in error.value.message and str(tmp_path / "config") in error.value.message


def test_a_client_config_or_address_not_utf8_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config").write_bytes(CLIENT_AUTH.encode() + b'[system]\nserver_name = "\xff"\n')
    with pytest.raises(ClientError, match="not UTF-8"):
        load_client_config(tmp_path / "config")
    (tmp_path / "config").write_text(CLIENT_AUTH)
    with pytest.raises(ClientError, match="not valid UTF-8"):
        load_client_config(tmp_path / "config", address=b"host\xff:1".decode(errors="surrogateescape"))


def test_aer_reports_an_odd_client_config_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "config").write_text('auth = "everything"\n')
    result = subprocess.run(
        [sys.executable, "-m", "auraed.aer", "--config", str(tmp_path / "config"), "health"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "[auth] must be a table" in result.stderr


def test_a_guest_lets_the_host_ping_it_as_often_as_the_host_may(tmp_path: Path) -> None:
    """The config a guest is given lets the host ping it every GUEST_PING_INTERVAL_MIN s, the
    shortest guest_keepalive_time the host accepts: a host pinging that often is not dropped."""
    from auraed.vms.guest_config import template_config
    from auraed.wire.channel import GUEST_PING_INTERVAL_MIN

    guest = load_config(
        ["--config", str(write_config(tmp_path, template_config(8443, "aurae-host")["auraed.toml"]))], {}
    )
    assert guest.keepalive_client_min_interval == GUEST_PING_INTERVAL_MIN
    host = load_config(["--config", "/dev/null", "--guest-keepalive-time", str(GUEST_PING_INTERVAL_MIN)], {})
    assert host.guest_keepalive_time == GUEST_PING_INTERVAL_MIN
    assert (
        load_config(["--config", "/dev/null"], {}).guest_keepalive_time,
        host.guest_keepalive_timeout,
    ) == (30.0, 20.0)


def test_only_a_guest_the_host_configured_skips_checking_its_credentials(tmp_path: Path) -> None:
    """Every daemon checks its credentials at start unless told not to; a host tells its guests,
    whose credentials it issues (a cold guest's config disk and a clone's identity alike)."""
    import ipaddress

    from auraed.pki import create_ca
    from auraed.vms.guest_config import GuestIdentity, config_files, template_config

    assert load_config([], {}).check_server_credentials
    assert not load_config(["--no-check-server-credentials"], {}).check_server_credentials
    cold = GuestIdentity("g1", ipaddress.IPv4Interface("10.213.0.2/30"), ipaddress.IPv4Address("10.213.0.1"))
    for text in (
        template_config(8443, "aurae-host")["auraed.toml"],
        config_files(cold, create_ca("test"), "aurae-host")["auraed.toml"],
    ):
        guest = load_config(["--config", str(write_config(tmp_path, text))], {})
        assert not guest.check_server_credentials


def test_a_vm_pod_is_a_q35_clone_of_a_template_unless_told_to_boot_cold(tmp_path: Path) -> None:
    default = load_config([], {})
    assert (default.cri_vm_boot, default.cri_vm_machine, default.vm_machine) == ("template", "q35", "microvm")
    assert default.vm_template_memory_mib == 256
    assert load_config(["--cri-vm-boot", "cold"], {}).cri_vm_boot == "cold"
    assert load_config(["--cri-vm-machine", "microvm"], {}).cri_vm_machine == "microvm"
    for text, said in (
        ('cri_vm_boot = "warm"\n', "cri_vm_boot: must be one of cold, template, not 'warm'"),
        ('cri_vm_machine = "pc"\n', "cri_vm_machine: must be one of microvm, q35, not 'pc'"),
        ("vm_template_memory_mib = 32\n", "vm_template_memory_mib: must be 64 to"),
    ):
        with pytest.raises(ConfigError) as error:
            load_config(["--config", str(write_config(tmp_path, text))], {})
        assert said in str(error.value)
