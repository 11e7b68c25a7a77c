"""What both APIs share: the client-error type, request-body reading, key checks, SSE framing and
the `dspark_flow` extension field."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from starlette.requests import ClientDisconnect, Request

from dspark_flow.errors import DsparkFlowError, PromptError
from dspark_flow.log import get_logger
from dspark_flow.pipeline import check_text, stop_strings
from dspark_flow.result import GenResult

log = get_logger()

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """A request body: strict types, no inf or nan; fields a client adds that we do not know
    are ignored (the SDKs send new ones before servers know them)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def utf8_text(value: Any, where: str = "it") -> Any:
    """Text that cannot be UTF-8 (a JSON escape such as \\ud800 decodes to a lone surrogate)
    as a validator's ValueError, so the 400 names the field it is in rather than the prompt the
    fields become (the tokenizer itself would raise a bare TypeError)."""
    if isinstance(value, str):
        try:
            check_text(value, where)
        except PromptError as e:
            raise ValueError(str(e)) from None
    return value


class TextPart(Strict):
    """One piece of message content (OpenAI: a content part, Anthropic: a content block)."""

    type: str
    text: str | None = None

    @field_validator("text")
    @classmethod
    def _utf8(cls, value: str | None) -> str | None:
        return utf8_text(value)


def parts_text(content: str | list[TextPart], noun: str) -> str:
    """The text of string or text-part content; any other part type is a client error."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text":
            raise ValueError(f"content {noun}s of type {part.type!r} are not supported")
        if part.text is None:
            raise ValueError(f"a text {noun} needs its 'text'")
        parts.append(part.text)
    return "".join(parts)


# Each stop string is looked for after every round: a request with thousands of them slowed its
# own decoding (and the queue behind it) sevenfold. OpenAI allows 4; a few more cost nothing.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1000


def check_stops(strings: list[str], what: str) -> None:
    """The library's own check of stop strings (`pipeline.stop_strings`: an empty one would end
    every output at once; one that is not UTF-8, a JSON escape such as \\ud800, could never
    match), and the server's limits, raised as the ValueError request validators raise."""
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} {what} per request, got {len(strings)}")
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in strings):
        raise ValueError(f"{what} are at most {MAX_STOP_CHARS} characters long")
    try:
        stop_strings(strings, what)
    except DsparkFlowError as e:
        raise ValueError(str(e)) from None


# Anthropic names its error types by status; OpenAI uses invalid_request_error for all 4xx.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error answered in the calling API's own envelope with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        # A message may repeat client text (a model name); a lone surrogate from a JSON escape
        # would fail to encode in the response and turn a 404 into a 500.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def openai_body(self) -> dict[str, Any]:
        kind = self.type or ("invalid_request_error" if self.status < 500 else "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, error: ApiError) -> dict[str, Any]:
    return error.anthropic_body() if is_anthropic_path(path) else error.openai_body()


# -- request reading ---------------------------------------------------------------------------


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes (checked before and while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # chunked uploads carry no content-length
                raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody is left to answer; an ApiError keeps it out of the catch-all handler, which
        # Starlette would re-raise into a traceback in the server's log.
        log.info("client went away before sending the whole body", path=request.url.path)
        raise ApiError(400, "the client closed the connection before the body ended") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


# Loc parts pydantic adds for the members of a union (`str | list[Part]` -> "str",
# "list[Part]"); no request field has such a name.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _is_tag(part: Any) -> bool:
    text = str(part)
    return "[" in text or text in _UNION_TAGS or text.startswith("function-")


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):  # pydantic's internal loc parts
            out += ("." if out else "") + str(part)
    return out


def _most_specific(errors: list[Any]) -> Any:
    """The error to report: for a value that matches no member of a union, one of the member
    that came closest (fewest errors), the deepest of its errors (`prompt[2]` of a token list
    with one string in it, `content[0].text` rather than "content is not a string")."""
    tags = [next((str(p) for p in e["loc"] if _is_tag(p)), None) for e in errors]
    count = {tag: tags.count(tag) for tag in tags}
    fewest = min(count.values())
    closest = [e for e, tag in zip(errors, tags, strict=True) if count[tag] == fewest]
    return max(closest, key=lambda e: len([p for p in e["loc"] if not _is_tag(p)]))


def parse_model(model: type[M], data: dict[str, Any]) -> M:
    """Validate a request body; the first problem becomes a 400 naming the parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = _most_specific(exc.errors(include_url=False))
        param = _loc(err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            message = f"missing required parameter: '{param}'"
        else:
            message = f"invalid value for '{param}': {msg}" if param else msg
        raise ApiError(400, message, param=param or None, code="invalid_value") from None


def check_api_key(request: Request, key: str | None) -> None:
    """OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`;
    either header is accepted on every route. Compared in constant time."""
    if key is None:
        return
    offered: list[str] = []
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        offered.append(auth[7:].strip())
    if "x-api-key" in request.headers:
        offered.append(request.headers["x-api-key"].strip())
    if not any(hmac.compare_digest(o.encode(), key.encode()) for o in offered):
        if offered:
            message = "invalid API key"
        elif auth:  # a key sent without its scheme, or another scheme
            message = "the Authorization header must read 'Bearer KEY'"
        else:
            message = "missing API key"
        raise ApiError(401, message, code="invalid_api_key")


# -- responses ---------------------------------------------------------------------------------


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Finished:
    """A generation's result with the figures the server adds to it."""

    result: GenResult
    prompt_tokens: int
    prefix_cached_tokens: int
    queue_seconds: float
    stop_sequence: str | None
    drafter: str

    def extension(self) -> dict[str, Any]:
        """The `dspark_flow` field: speculation figures (clients ignore unknown fields)."""
        r = self.result
        return {
            "mean_accept_len": round(r.mean_accept_len, 4),
            "decode_tokens_per_sec": round(r.decode_tokens_per_sec, 3),
            "tokens_per_sec": round(r.tokens_per_sec, 3),
            "ttft_seconds": round(r.ttft_seconds, 4),
            "prefill_seconds": round(r.prefill_seconds, 4),
            "queue_seconds": round(self.queue_seconds, 4),
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": r.num_tokens,
            "num_rounds": r.num_rounds,
            "target_forwards": r.target_forwards,
            "drafter": self.drafter,
        }
