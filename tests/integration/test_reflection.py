"""Server reflection on a real gateway process: v1 (what current grpcurl, buf curl and Postman
speak) and v1alpha list GenerateService's methods, and the descriptors they return carry the
proto comments. The gateway needs no live worker for that: it points at a closed port."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from tests.integration.procs import Proc, start_gateway

BUF_MISSING = "buf is not on PATH (npm install -g @bufbuild/buf@1.75.0); set DRAFTWISE_REQUIRE_BUF=1 to fail instead"
METHODS = {
    "draftwise.v1.GenerateService/Generate",
    "draftwise.v1.GenerateService/GenerateStream",
    "draftwise.v1.GenerateService/ListModels",
}
PATHS = {
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    g = start_gateway([], tmp_path_factory.mktemp("reflection"), "gateway", "--worker=127.0.0.1:1")
    yield g
    g.stop()


def _buf() -> str:
    exe = shutil.which("buf")
    if exe is None:
        if os.environ.get("DRAFTWISE_REQUIRE_BUF"):
            pytest.fail(BUF_MISSING)
        pytest.skip(BUF_MISSING)
    return exe


def _reflect(address: str, version: str, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    """Send ``requests`` on one reflection stream of ``version``; the responses, in order."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            PATHS[version],
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=10))


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_buf_curl_lists_the_methods(gateway: Proc, protocol: str) -> None:
    res = subprocess.run(
        [_buf(), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--reflect-protocol", protocol]
        + ["--list-methods", f"http://{gateway.address}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    methods = set(res.stdout.split())
    assert methods >= METHODS, res.stdout
    assert "grpc.health.v1.Health/Check" in methods
    assert not any("WorkerService" in m for m in methods), "the internal service is not the gateway's"


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_services_listed(gateway: Proc, version: str) -> None:
    (resp,) = _reflect(gateway.address, version, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in resp.list_services_response.service}
    assert names == {
        "draftwise.v1.GenerateService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def _comment(fd: descriptor_pb2.FileDescriptorProto, path: list[int]) -> str:
    return next((loc.leading_comments for loc in fd.source_code_info.location if list(loc.path) == path), "")


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_descriptors_carry_the_comments(gateway: Proc, version: str) -> None:
    (resp,) = _reflect(
        gateway.address,
        version,
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="draftwise.v1.GenerateService"),
    )
    files = {
        f.name: f
        for f in map(descriptor_pb2.FileDescriptorProto.FromString, resp.file_descriptor_response.file_descriptor_proto)
    }
    assert set(files) == {"draftwise/v1/generate_service.proto", "draftwise/v1/generation.proto"}
    svc = files["draftwise/v1/generate_service.proto"]
    assert _comment(svc, [6, 0]).startswith(" Text generation."), svc.source_code_info.location[:3]
    assert "One request, its events streamed back" in _comment(svc, [6, 0, 2, 1])
    generation = files["draftwise/v1/generation.proto"]
    event = [m.name for m in generation.message_type].index("GenerationEvent")
    assert "One event about one request" in _comment(generation, [4, event])
    assert svc.options.go_package.endswith(";draftwisev1")


def test_the_v1_reflection_service_resolves_itself(gateway: Proc) -> None:
    (resp,) = _reflect(
        gateway.address,
        "v1",
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    )
    (data,) = resp.file_descriptor_response.file_descriptor_proto
    fd = descriptor_pb2.FileDescriptorProto.FromString(data)
    assert (fd.name, fd.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    method = fd.service[0].method[0]
    assert (method.input_type, method.output_type) == (
        ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse",
    )


def test_unknown_symbol_is_not_found(gateway: Proc) -> None:
    (resp,) = _reflect(
        gateway.address,
        "v1",
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="draftwise.v1.WorkerService"),
    )
    assert resp.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_malformed_bytes_are_invalid_argument(gateway: Proc) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        call = channel.stream_stream(PATHS["v1"], request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([b"\xff\xff\xff"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed message" in info.value.details()


def test_comments_come_from_the_committed_set_not_the_pb2_modules() -> None:
    """Why the gateway serves generate_service.binpb: the _pb2 modules' descriptors have no comments."""
    from draftwise.v1 import generate_service_pb2

    fd = descriptor_pb2.FileDescriptorProto.FromString(generate_service_pb2.DESCRIPTOR.serialized_pb)
    assert not fd.source_code_info.location
    assert Path(generate_service_pb2.__file__).with_name("generate_service.binpb").is_file()
