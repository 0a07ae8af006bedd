from draftwise.v1 import generation_pb2 as _generation_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerServiceGenerateRequest(_message.Message):
    __slots__ = ("start", "cache_salt", "stream_interval")
    START_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    start: _generation_pb2.StartGeneration
    cache_salt: str
    stream_interval: int
    def __init__(self, start: _Optional[_Union[_generation_pb2.StartGeneration, _Mapping]] = ..., cache_salt: _Optional[str] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class WorkerServiceGenerateResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _generation_pb2.GenerationEvent
    def __init__(self, event: _Optional[_Union[_generation_pb2.GenerationEvent, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("model", "num_requests_running", "num_requests_waiting", "num_free_kv_blocks", "num_total_kv_blocks", "tokens_per_second", "draining", "prefix_cache_queries", "prefix_cache_hits", "num_cached_kv_blocks", "worker_started_at", "constrained_requests", "grammar_compile_seconds", "grammar_mask_seconds", "grammar_masked_steps")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MASKED_STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_requests_running: int
    num_requests_waiting: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    tokens_per_second: float
    draining: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cached_kv_blocks: int
    worker_started_at: float
    constrained_requests: int
    grammar_compile_seconds: float
    grammar_mask_seconds: float
    grammar_masked_steps: int
    def __init__(self, model: _Optional[str] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_total_kv_blocks: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., draining: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_cached_kv_blocks: _Optional[int] = ..., worker_started_at: _Optional[float] = ..., constrained_requests: _Optional[int] = ..., grammar_compile_seconds: _Optional[float] = ..., grammar_mask_seconds: _Optional[float] = ..., grammar_masked_steps: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait", "resume")
    WAIT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    resume: bool
    def __init__(self, wait: _Optional[bool] = ..., resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_requests_in_flight",)
    NUM_REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_requests_in_flight: int
    def __init__(self, num_requests_in_flight: _Optional[int] = ...) -> None: ...
