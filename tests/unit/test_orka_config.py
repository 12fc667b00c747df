"""The node agent's and the metrics' settings: defaults, and what is refused naming the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from auraed.config import build_argument_parser, load_config
from auraed.errors import ConfigError


def test_defaults_are_off_and_orkas() -> None:
    config = load_config([], {})
    assert (config.orka_scheduler, config.metrics_listen) == ("", "")
    assert config.orka_listen == "[::]:50052"  # orka's node agent port
    assert (config.orka_join_retry_interval, config.orka_join_attempts) == (5.0, 3)  # orka's 3
    assert (config.orka_status_interval, config.orka_workload_status_interval) == (15.0, 1.0)
    assert config.orka_join_failure == "exit" and not config.orka_plaintext
    assert config.orka_scheduler_ca is None  # plain to the scheduler
    assert (config.orka_workload_isolation, config.orka_vm_vcpus, config.orka_vm_memory_mib) == (
        "host", 1, 768,
    )  # fmt: skip


def test_the_schedulers_ca_is_a_path_read_beside_the_config_file(tmp_path: Path) -> None:
    config_file = tmp_path / "etc" / "auraed.toml"
    config_file.parent.mkdir()
    config_file.write_text('orka_scheduler_ca = "pki/orka-ca.crt"\n')
    config = load_config(["--config", str(config_file)], {})
    assert config.orka_scheduler_ca == tmp_path / "etc" / "pki" / "orka-ca.crt"
    # From a flag or the environment, a relative path is the directory auraed starts in; empty
    # is off, wherever it comes from.
    assert load_config(["--orka-scheduler-ca", "ca.crt"], {}).orka_scheduler_ca == Path("ca.crt")
    config_file.write_text('orka_scheduler_ca = ""\n')
    assert load_config(["--config", str(config_file)], {}).orka_scheduler_ca is None
    assert load_config([], {"AURAED_ORKA_SCHEDULER_CA": ""}).orka_scheduler_ca is None


def test_settings_come_from_the_environment_too() -> None:
    environ = {"AURAED_ORKA_SCHEDULER": "sched:50051", "AURAED_ORKA_JOIN_ATTEMPTS": "7"}
    config = load_config(["--orka-join-failure", "serve"], environ)
    assert (config.orka_scheduler, config.orka_join_attempts, config.orka_join_failure) == (
        "sched:50051", 7, "serve",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--orka-scheduler", "no-port"], "orka_scheduler: expected host:port"),
        (["--orka-listen", "[::]:70000"], "orka_listen: the port must be a number"),
        (["--metrics-listen", "::1:9464"], "metrics_listen: an IPv6 address goes between brackets"),
        (["--orka-join-failure", "retry"], "orka_join_failure: must be exit or serve"),
        (["--orka-join-attempts", "0"], "orka_join_attempts: must be 1 to 1000"),
        (["--orka-status-interval", "0"], "orka_status_interval: must be more than 0"),
        (["--orka-workload-status-interval", "nan"], "must be a finite number"),
        (["--orka-scheduler", "s:1", "--orka-listen", ""], "orka_listen: the WorkloadService needs"),
        (["--orka-scheduler", "s:1", "--orka-scheduler-identity", ""], "orka_scheduler_identity"),
        (["--orka-workload-isolation", "cell"], "orka_workload_isolation: must be host or vm"),
        (["--orka-vm-vcpus", "0"], "orka_vm_vcpus: must be 1 to 255"),
        (["--orka-vm-memory-mib", "32"], "orka_vm_memory_mib: must be 64 to"),
    ],
)
def test_refused_settings_are_named(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(flags, {})


def test_orka_join_retries_is_refused_wherever_given_saying_what_to_set(tmp_path: Path) -> None:
    """It counted the attempts after the first; orka_join_attempts counts them all. A number
    meant the old way is refused rather than run one attempt short."""
    why = "replaced by orka_join_attempts, which counts every attempt, the first too: "
    config_file = tmp_path / "auraed.toml"
    config_file.write_text("orka_join_retries = 3\n")
    for flags, environ, source in [
        (["--config", str(config_file)], {}, f"{config_file}: orka_join_retries"),
        ([], {"AURAED_ORKA_JOIN_RETRIES": "3"}, "AURAED_ORKA_JOIN_RETRIES"),
        (["--orka-join-retries", "3"], {}, "--orka-join-retries"),
    ]:
        with pytest.raises(ConfigError) as refused:
            load_config(flags, environ)
        assert str(refused.value) == f"{source}: {why}orka_join_retries = N is orka_join_attempts = N + 1"
    assert "--orka-join-retries" not in build_argument_parser().format_help()  # not offered


def test_a_daemon_without_metrics_never_imports_prometheus_client() -> None:
    code = (
        "import sys, auraed.server.daemon, auraed.images.images, auraed.vms.guests, auraed.orka.workloads,"
        " auraed.orka.guest;"
        "sys.exit('prometheus_client' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
