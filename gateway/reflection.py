"""gRPC server reflection for the gateway: ``grpc.reflection.v1.ServerReflection`` (what current
grpcurl, buf curl and Postman speak) and ``grpc.reflection.v1alpha.ServerReflection`` (older
tools), answering with descriptors that carry the proto comments.

grpcio-reflection implements v1alpha only; v1's messages are the same messages under another
package (field for field, number for number), so one servicer answers both, registered a second
time under v1's service name, and a v1 descriptor of the reflection service itself is derived
from v1alpha's so that tools can resolve it too. The descriptors inside the generated *_pb2
modules carry no source info; the public contract's files are served from
``draftwise/v1/generate_service.binpb`` instead (made by scripts/gen_proto.py with
``--include_source_info``), so a client sees each service's, method's and field's comment.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
"""grpc.reflection.v1alpha.ServerReflection"""
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
"""The reflection service's current name."""
Request = reflection_pb2.ServerReflectionRequest
Response = reflection_pb2.ServerReflectionResponse
SOURCE_SET = "generate_service.binpb"
"""The public contract with its comments, a resource of the draftwise.v1 package."""


def contract_files() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """The public contract's files with their source code info: {file name: descriptor}."""
    data = importlib.resources.files("draftwise.v1").joinpath(SOURCE_SET).read_bytes()
    return {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(data).file}


def v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, derived from v1alpha's (the same messages)."""
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:  # (no nested messages in it)
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = "grpc.reflection.v1"
    proto.ClearField("options")
    return proto


def _proto_of(module_descriptor: Any) -> descriptor_pb2.FileDescriptorProto:  # a FileDescriptor (python or upb)
    return descriptor_pb2.FileDescriptorProto.FromString(module_descriptor.serialized_pb)


def reflection_files() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """Every file reflection can answer with: the contract (with comments), health, reflection."""
    files = {f.name: f for f in (_proto_of(health_pb2.DESCRIPTOR), _proto_of(reflection_pb2.DESCRIPTOR))}
    v1 = v1_reflection_file()
    files[v1.name] = v1
    files.update(contract_files())
    return files


class SourceReflectionServicer(ReflectionServicer):
    """grpcio-reflection's asyncio servicer over its own pool of ``files``, answering with the
    files as given (a pool's descriptors lose their source info on the way out)."""

    def __init__(self, service_names: Iterable[str], files: Mapping[str, descriptor_pb2.FileDescriptorProto]) -> None:
        pool = descriptor_pool.DescriptorPool()
        added: set[str] = set()

        def add(name: str) -> None:
            if name not in added:
                for dep in files[name].dependency:
                    add(dep)
                pool.Add(files[name])
                added.add(name)

        for name in files:
            add(name)
        super().__init__(service_names, pool=pool)
        self._serialized = {name: f.SerializeToString() for name, f in files.items()}

    def _with_source(
        self, response: reflection_pb2.ServerReflectionResponse
    ) -> reflection_pb2.ServerReflectionResponse:
        if response.HasField("file_descriptor_response"):
            protos = response.file_descriptor_response.file_descriptor_proto
            for i, data in enumerate(protos):
                name = descriptor_pb2.FileDescriptorProto.FromString(data).name
                protos[i] = self._serialized.get(name, data)
        return response

    def _file_by_filename(self, request: Request, filename: str) -> Response:
        return self._with_source(
            super()._file_by_filename(  # pyright: ignore[reportAttributeAccessIssue]  (grpc_reflection's private helper)
                request, filename
            )
        )

    def _file_containing_symbol(self, request: Request, fully_qualified_name: str) -> Response:
        return self._with_source(
            super()._file_containing_symbol(  # pyright: ignore[reportAttributeAccessIssue]  (grpc_reflection's private helper)
                request, fully_qualified_name
            )
        )

    def _file_containing_extension(self, request: Request, containing_type: str, extension_number: int) -> Response:
        return self._with_source(
            super()._file_containing_extension(  # pyright: ignore[reportAttributeAccessIssue]  (grpc_reflection's private helper)
                request, containing_type, extension_number
            )
        )


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> SourceReflectionServicer:
    """Serve reflection v1 and v1alpha on ``server`` for ``service_names`` (and themselves)."""
    names = (*service_names, V1ALPHA_SERVICE, V1_SERVICE)
    servicer = SourceReflectionServicer(names, reflection_files())
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
    return servicer
