"""OpenAI request/response models (pydantic): unknown fields are rejected, accepted ones are honoured."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.errors import bad_request

INT64 = (-(2**63), 2**63 - 1)
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (a value or an object key) that holds an unpaired UTF-16
    surrogate, which JSON can carry as an escape but which is not Unicode text."""
    if isinstance(value, str):
        return (path or "body") if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return here
        found = lone_surrogate_at(item, here)
        if found is not None:
            return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Request):
    name: str
    arguments: str


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Request):
    type: Literal["text"]
    text: str


class _Message(_Request):
    name: str | None = None

    def text(self) -> str:
        content = getattr(self, "content", None)
        if isinstance(content, list):
            return "".join(p.text for p in content)
        return content or ""


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: str | list[TextPart]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantMessageIn(_Message):
    """An earlier assistant turn; the fields the openai client echoes back when a response message is
    appended as is are accepted when empty (they carry nothing the prompt could use)."""

    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    # the reasoning an earlier response returned (harmony's analysis), as the openai client echoes it back
    reasoning_content: str | None = None
    refusal: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessageIn | ToolMessage, Field(discriminator="role")]


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class SqlFormat(_Request):
    """moegate extension: generate one read-only SQL statement over the caller's schema."""

    tables: Annotated[dict[str, list[str]], Field(min_length=1, description="table -> column names")]
    dialect: str | None = Field(None, description="sqlite, postgres, mysql, duckdb, bigquery, snowflake")
    database: str | None = Field(None, description="a database named in the policy (its rules apply)")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "sql"]
    json_schema: JsonSchemaFormat | None = None
    sql: SqlFormat | None = None

    @model_validator(mode="after")
    def _payload(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.type == "sql" and self.sql is None:
            raise ValueError("response_format of type sql needs a sql object (tables, dialect)")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: Annotated[str, Field(min_length=1)]
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # extension, as in vLLM
    n: Annotated[int, Field(ge=1, le=8)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1], description="a signed 64-bit integer")] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None

    def reject_invalid_unicode(self) -> None:
        """400 naming the first field whose text holds an unpaired surrogate: no tokenizer, grammar or stop
        matcher can take it. `user`, an opaque caller id, is kept as sent (the audit log escapes it)."""
        where = lone_surrogate_at(self.model_dump(by_alias=True, exclude_none=True, exclude={"user"}))
        if where is not None:
            raise bad_request(f"'{where}' contains an unpaired UTF-16 surrogate (e.g. \\ud800), which is not "
                              "Unicode text; send valid UTF-8 text", where, "invalid_unicode")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class MoegateExtension(_Request):
    """moegate's request extension (send it as `extra_body={"moegate": {...}}`)."""

    sql: SqlFormat | None = Field(None, description="database schema for ```sql fences in free text")


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    moegate: MoegateExtension | None = None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | list[int]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


# ---- responses ---------------------------------------------------------------------------------
class _IdSource:
    """Unique, unguessable ids without a system call per id: a keyed hash (BLAKE2b, a key from os.urandom once per
    process, again in a forked child) of a counter. On the event loop a call that releases the interpreter lock, as
    os.urandom (uuid4) does, waits milliseconds to take it back from a busy engine thread."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._key, self._count = os.urandom(32), itertools.count()

    def hex(self, chars: int = 24) -> str:
        n = next(self._count)
        return hashlib.blake2b(n.to_bytes(8, "little"), key=self._key, digest_size=(chars + 1) // 2).hexdigest()[:chars]


_IDS = _IdSource()


def random_hex(chars: int = 24) -> str:
    """`chars` hex digits of a process-unique, unguessable id (ids of responses, tool calls, records)."""
    return _IDS.hex(chars)


def new_id(prefix: str) -> str:
    return f"{prefix}-{random_hex()}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # the model's reasoning, where its family writes it apart (harmony)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str
    moegate: dict[str, Any] | None = Field(None, description="extension: mode decisions per choice")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str
    moegate: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moegate"
    moegate: dict[str, Any] | None = None  # the engine's placement plan (where each part of the model lives)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
