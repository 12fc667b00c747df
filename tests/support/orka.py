"""Driving auraed as an orka node: our scheduler process (orka_scheduler.py), a certificate as
orka's scheduler makes itself, and a client of the node's WorkloadService, as an orka scheduler
calls it."""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from auraed.api import node_agent as na
from auraed.wire import codec

REPO = Path(__file__).resolve().parent.parent.parent
WORKLOADS = "node_agent.WorkloadService"


def orka_scheduler_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate as orka's scheduler makes itself at its first start (staging: scheduler/src/
    tls/manager.rs, rcgen's defaults): self-signed, an ECDSA P-256 key, no CA bit, localhost its
    only name; written as orka names the files (scheduler.pem, scheduler.key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Orka"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Scheduler"),
            x509.NameAttribute(NameOID.COMMON_NAME, "Orka Scheduler TLS certificate"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    crt, key_file = directory / "scheduler.pem", directory / "scheduler.key"
    crt.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return crt, key_file


class SchedulerProcess:
    """One run of tests/support/orka_scheduler.py on ``port``; its events are read from a file
    shared by every run of it, so a restart keeps the history."""

    def __init__(self, port: int, events: Path) -> None:
        self.port = port
        self.events_path = events
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *args: str) -> None:
        seen = len(self.events())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.orka_scheduler", "--listen", self.address,
             "--events", str(self.events_path), *args],
            cwd=REPO, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.wait_for(lambda e: e["event"] == "listening", after=seen, timeout=20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.endswith("}")]
        return [e for e in events if kind is None or e["event"] == kind]

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], after: int = 0, timeout: float = 10.0
    ) -> dict[str, Any]:
        """The first event from index ``after`` on that ``predicate`` takes, waiting for it."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events()[after:]:
                if predicate(event):
                    return event
            if self.process is not None and self.process.poll() is not None:
                stderr = self.process.stderr.read().decode() if self.process.stderr else ""
                raise AssertionError(f"the scheduler exited with {self.process.returncode}: {stderr}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no such event in time; events: {self.events()[after:]}")
            time.sleep(0.02)


class WorkloadClient:
    """The node's WorkloadService, called as a scheduler does (over mTLS with its certificate,
    or plain)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    @classmethod
    def connect(
        cls, address: str, ca: Path | None = None, crt: Path | None = None, key: Path | None = None
    ) -> WorkloadClient:
        if ca is None:
            return cls(grpc.aio.insecure_channel(address))
        assert crt is not None and key is not None
        credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), crt.read_bytes())
        options = [("grpc.ssl_target_name_override", "localhost")]
        return cls(grpc.aio.secure_channel(address, credentials, options=options))

    async def create(self, workload: na.Workload, timeout: float = 60) -> AsyncIterator[na.WorkloadStatus]:
        call = self.channel.unary_stream(f"/{WORKLOADS}/Create")(codec.encode(workload), timeout=timeout)
        async for reply in call:
            yield codec.decode(na.WorkloadStatus, reply)

    async def signal(self, instance_id: str, signal: na.WorkloadSignalSignal, timeout: float = 30) -> None:
        request = codec.encode(na.WorkloadSignal(instance_id=instance_id, signal=signal))
        await self.channel.unary_unary(f"/{WORKLOADS}/Signal")(request, timeout=timeout)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.channel.close()
