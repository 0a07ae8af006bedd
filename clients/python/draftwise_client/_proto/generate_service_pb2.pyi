from draftwise_client._proto import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculativeMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATIVE_METHOD_UNSPECIFIED: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_DRAFT_MODEL: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_NGRAM: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_EAGLE: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_MEDUSA: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_SUFFIX: _ClassVar[SpeculativeMethod]
SPECULATIVE_METHOD_UNSPECIFIED: SpeculativeMethod
SPECULATIVE_METHOD_DRAFT_MODEL: SpeculativeMethod
SPECULATIVE_METHOD_NGRAM: SpeculativeMethod
SPECULATIVE_METHOD_EAGLE: SpeculativeMethod
SPECULATIVE_METHOD_MEDUSA: SpeculativeMethod
SPECULATIVE_METHOD_SUFFIX: SpeculativeMethod

class GenerateRequest(_message.Message):
    __slots__ = ("start", "cancel", "resume")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    start: _generation_pb2.StartGeneration
    cancel: _generation_pb2.CancelGeneration
    resume: ResumeGeneration
    def __init__(self, start: _Optional[_Union[_generation_pb2.StartGeneration, _Mapping]] = ..., cancel: _Optional[_Union[_generation_pb2.CancelGeneration, _Mapping]] = ..., resume: _Optional[_Union[ResumeGeneration, _Mapping]] = ...) -> None: ...

class ResumeGeneration(_message.Message):
    __slots__ = ("resume_handle", "next_token_index", "request_id")
    RESUME_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    resume_handle: str
    next_token_index: int
    request_id: str
    def __init__(self, resume_handle: _Optional[str] = ..., next_token_index: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _generation_pb2.GenerationEvent
    def __init__(self, event: _Optional[_Union[_generation_pb2.GenerationEvent, _Mapping]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("start", "resume")
    START_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    start: _generation_pb2.StartGeneration
    resume: ResumeGeneration
    def __init__(self, start: _Optional[_Union[_generation_pb2.StartGeneration, _Mapping]] = ..., resume: _Optional[_Union[ResumeGeneration, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _generation_pb2.GenerationEvent
    def __init__(self, event: _Optional[_Union[_generation_pb2.GenerationEvent, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_model_len", "has_draft", "speculative_method", "draft_model", "num_speculative_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_model_len: int
    has_draft: bool
    speculative_method: SpeculativeMethod
    draft_model: str
    num_speculative_tokens: int
    def __init__(self, name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., has_draft: _Optional[bool] = ..., speculative_method: _Optional[_Union[SpeculativeMethod, str]] = ..., draft_model: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "default_model")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    default_model: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., default_model: _Optional[str] = ...) -> None: ...
