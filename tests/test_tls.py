"""TLS and mutual TLS with real sockets and certificates the test makes (a CA, a server
certificate for 127.0.0.1, and a client certificate)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.conftest import EMBEDDED_NAME, REPO, ServerProcess, start_server, wait_ready


@dataclass
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _issue(
    subject: str,
    key,
    issuer_name,
    issuer_key,
    *,
    ca: bool = False,
    server: bool = False,
    client: bool = False,
):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca_cert = _issue("test CA", ca_key, ca_name, ca_key, ca=True)
    files = {}

    def write(name: str, cert, key) -> None:
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}.key").write_bytes(_key_pem(key))
        files[name] = (root / f"{name}.pem", root / f"{name}.key")

    write("ca", ca_cert, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    write("server", _issue("127.0.0.1", server_key, ca_name, ca_key, server=True), server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    write("client", _issue("client", client_key, ca_name, ca_key, client=True), client_key)
    rogue_ca_key = ec.generate_private_key(ec.SECP256R1())
    rogue_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rogue CA")])
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    write("rogue", _issue("rogue", rogue_key, rogue_name, rogue_ca_key, client=True), rogue_key)
    return PKI(files["ca"][0], *files["server"], *files["client"], *files["rogue"])


def start_tls(tmp_path: Path, pki: PKI, mode: str) -> ServerProcess:
    env = {
        "NIM_SSL_MODE": mode,
        "NIM_SSL_KEY_PATH": str(pki.server_key),
        "NIM_SSL_CERTS_PATH": str(pki.server_cert),
        "NIM_SSL_CA_CERTS_PATH": str(pki.ca),
    }
    server = start_server(tmp_path / "log", env=env)
    server.base_url = server.base_url.replace("http://", "https://")
    return server


def tls_client(pki: PKI, cert: tuple[Path, Path] | None = None) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return httpx.Client(verify=context, timeout=60)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[ServerProcess]:
    server = start_tls(tmp_path_factory.mktemp("tls"), pki, "TLS")
    try:
        wait_ready(server, client=tls_client(pki))
        yield server
    finally:
        server.stop()


def test_tls_serves_https_with_the_openai_client(tls_server: ServerProcess, pki: PKI) -> None:
    client = openai.OpenAI(
        base_url=f"{tls_server.base_url}/v1", api_key="unused", max_retries=0, http_client=tls_client(pki)
    )
    out = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
    )
    assert out.usage.completion_tokens >= 1
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken on the TLS port
        httpx.get(tls_server.base_url.replace("https://", "http://") + "/v1/health/live", timeout=5)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA refuses the server
        httpx.get(f"{tls_server.base_url}/v1/health/live", timeout=5)


def test_mtls_requires_a_client_certificate_from_the_ca(tmp_path: Path, pki: PKI) -> None:
    server = start_tls(tmp_path, pki, "MTLS")
    try:
        wait_ready(server, client=tls_client(pki, (pki.client_cert, pki.client_key)))
        with tls_client(pki, (pki.client_cert, pki.client_key)) as good:
            assert good.get(f"{server.base_url}/v1/models").status_code == 200
        for cert in (None, (pki.rogue_cert, pki.rogue_key)):
            with pytest.raises(httpx.HTTPError), tls_client(pki, cert) as bad:
                bad.get(f"{server.base_url}/v1/models")
    finally:
        assert server.stop() == 0


def test_tls_without_files_stops_start_up(tmp_path: Path) -> None:
    server = start_server(tmp_path / "log", env={"NIM_SSL_MODE": "TLS"})
    assert server.process.wait(60) == 2
    assert "NIM_SSL_KEY_PATH" in server.log()


def test_health_command_checks_a_tls_server(tls_server: ServerProcess, pki: PKI) -> None:
    """The image's HEALTHCHECK: `entrypoint.py health` speaks TLS when NIM_SSL_MODE asks for it."""
    port = tls_server.base_url.rsplit(":", 1)[1]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("NIM_")},
        "NIM_SSL_MODE": "TLS",
        "NIM_SSL_KEY_PATH": str(pki.server_key),
        "NIM_SSL_CERTS_PATH": str(pki.server_cert),
        "NIM_SERVER_PORT": port,
    }
    command = [sys.executable, str(REPO / "entrypoint.py"), "health"]
    ready = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert "ready (200)" in ready.stdout
    plain = subprocess.run(command, env={**env, "NIM_SSL_MODE": "DISABLED"}, capture_output=True, text=True)
    assert plain.returncode == 1  # plain HTTP to a TLS port: not an answer
    assert "not answering" in plain.stdout
