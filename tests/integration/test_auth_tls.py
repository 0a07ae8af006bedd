"""API keys (from a file and from an environment variable): without a valid key every
GenerateService call is UNAUTHENTICATED, while health checking and reflection stay open.
TLS: the gateway serves over TLS with a certificate and key."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from tests.integration.procs import ROOT, child_env, start_gateway
from tests.integration.rpc import start, start_req

FILE_KEYS = ("key-one", "key-two")
ENV_KEY = "env-key-three"


@pytest.fixture(scope="module")
def keys_file(proc_dir):
    path = proc_dir / "api-keys.txt"
    path.write_text(f"# accepted keys\n{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  \n")
    return path


@pytest.fixture(scope="module")
def auth_gateway(workers, proc_dir, keys_file):
    env = child_env(DRAFTWISE_API_KEYS=ENV_KEY)
    g = start_gateway(workers, proc_dir, "gateway-auth", f"--api-key-file={keys_file}", env=env)
    yield g
    g.stop()


def _md(key: str | None) -> tuple[tuple[str, str], ...]:
    return () if key is None else (("authorization", key),)


async def _calls(address: str, metadata, channel_factory=grpc.aio.insecure_channel) -> dict[str, object]:
    """The status code of each GenerateService method called with ``metadata``."""
    out: dict[str, object] = {}
    async with channel_factory(address) as ch:
        stub = gsgrpc.GenerateServiceStub(ch)
        try:
            await stub.ListModels(gspb.ListModelsRequest(), metadata=metadata, timeout=10)
            out["ListModels"] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            out["ListModels"] = e.code()
            out["message"] = e.details()
        call = stub.GenerateStream(
            gspb.GenerateStreamRequest(start=start("", max_tokens=2, temperature=0)), metadata=metadata, timeout=30
        )
        try:
            async for _ in call:
                pass
            out["GenerateStream"] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            out["GenerateStream"] = e.code()
        bidi = stub.Generate(metadata=metadata, timeout=30)
        try:
            await bidi.write(start_req(start("a", max_tokens=2, temperature=0)))
            await bidi.done_writing()
            async for _ in bidi:
                pass
        except grpc.aio.AioRpcError:
            pass
        out["Generate"] = await bidi.code()
    return out


@pytest.mark.parametrize(
    "auth,why",
    [
        (None, "missing API key"),
        ("Bearer wrong-key", "invalid API key"),
        (f"Bearer {FILE_KEYS[0]}x", "invalid API key"),
        (f"Basic {FILE_KEYS[0]}", "malformed"),
        ("Bearer ", "malformed"),
    ],
)
def test_missing_or_wrong_key_is_unauthenticated(auth_gateway, auth, why):
    out = asyncio.run(_calls(auth_gateway.address, _md(auth)))
    for method in ("ListModels", "GenerateStream", "Generate"):
        assert out[method] == grpc.StatusCode.UNAUTHENTICATED, (method, out)
    assert why in out["message"]


@pytest.mark.parametrize("key", [*FILE_KEYS, ENV_KEY])
def test_valid_keys_from_file_and_environment(auth_gateway, key):
    out = asyncio.run(_calls(auth_gateway.address, _md(f"Bearer {key}")))
    assert {m: out[m] for m in ("ListModels", "GenerateStream", "Generate")} == dict.fromkeys(
        ("ListModels", "GenerateStream", "Generate"), grpc.StatusCode.OK
    )


def test_health_and_reflection_need_no_key(auth_gateway):
    async def main():
        async with grpc.aio.insecure_channel(auth_gateway.address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(timeout=5)
            await refl.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            await refl.done_writing()
            names = [s.name async for r in refl for s in r.list_services_response.service]
            return health.status, names

    status, names = asyncio.run(main())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "draftwise.v1.GenerateService" in names and "grpc.health.v1.Health" in names


@pytest.fixture(scope="module")
def tls_files(proc_dir):
    openssl = shutil.which("openssl")
    assert openssl, "the TLS test needs the openssl command to make a self-signed certificate"
    cert, key = proc_dir / "cert.pem", proc_dir / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_gateway(workers, proc_dir, tls_files, keys_file):
    cert, key = tls_files
    g = start_gateway(
        workers, proc_dir, "gateway-tls", f"--tls-cert={cert}", f"--tls-key={key}", f"--api-key-file={keys_file}"
    )
    yield g
    g.stop()


def test_tls_with_keys(tls_gateway, tls_files):
    cert, _ = tls_files
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())

    def secure(address: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, creds)

    ok = asyncio.run(_calls(tls_gateway.address, _md(f"Bearer {FILE_KEYS[1]}"), secure))
    assert ok["GenerateStream"] == ok["Generate"] == ok["ListModels"] == grpc.StatusCode.OK
    no_key = asyncio.run(_calls(tls_gateway.address, (), secure))
    assert no_key["GenerateStream"] == grpc.StatusCode.UNAUTHENTICATED
    plain = asyncio.run(_calls(tls_gateway.address, _md(f"Bearer {FILE_KEYS[1]}")))  # no TLS: no connection
    assert plain["ListModels"] == grpc.StatusCode.UNAVAILABLE
    # the command line client over TLS, with a key from the environment
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", "def f(x):", "--max-tokens=4"]
        + [f"--server={tls_gateway.address}", f"--tls-ca={cert}"],
        env=child_env(DRAFTWISE_API_KEY=FILE_KEYS[0]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and res.stdout.startswith("def f(x):"), res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", "x", f"--server={tls_gateway.address}", f"--tls-ca={cert}"],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "UNAUTHENTICATED" in res.stderr


def test_a_tls_mismatch_says_so(tls_gateway, auth_gateway, tls_files):
    """A plaintext client against a TLS server only sees its socket closed, a TLS client against a
    plaintext server a failed handshake: the command line says what to try, in one line."""
    cert, _ = tls_files

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "draftwise.cli", "generate", "x", "--max-tokens=2", *argv],
            env=child_env(DRAFTWISE_API_KEY=FILE_KEYS[0]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    plain = run(f"--server={tls_gateway.address}")
    assert plain.returncode == 1 and "add --tls" in plain.stderr and "Traceback" not in plain.stderr, plain.stderr
    waited = run(f"--server={tls_gateway.address}", "--wait=1")
    assert waited.returncode == 1 and "add --tls" in waited.stderr, waited.stderr
    tls = run(f"--server={auth_gateway.address}", f"--tls-ca={cert}")
    assert tls.returncode == 1 and "TLS handshake failed" in tls.stderr and "Traceback" not in tls.stderr, tls.stderr
