"""OpenAI-compatible request models and response/SSE builders (chat completions, completions).

Requests are validated strictly (no "10" for 10, no true for 1): a wrong type is a 400 naming
the parameter, not a silent coercion. Fields this server does not know are ignored (clients
send extras such as `user`), but settings that would change the output in a way it cannot honour
(n > 1, penalties, logprobs, tools or functions, a response_format other than text) are refused
rather than dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dspark_flow.server.common import (
    ApiError,
    Finished,
    Strict,
    TextPart,
    check_stops,
    parts_text,
    sse,
    utf8_text,
)
from dspark_flow.server.engine import Job

ContentPart = TextPart  # OpenAI's name for a piece of content


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None

    @field_validator("content")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        if isinstance(value, list):  # other part types refused here, where the 400 names them
            parts_text(value, "part")
        return utf8_text(value)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # Tools are not served; a past turn's calls would vanish from the prompt unseen.
        if self.tool_calls or self.function_call:
            raise ValueError("tool calls are not supported")
        # OpenAI lets only an assistant turn (one that made tool calls) have no content; a user
        # turn without any is a client bug better named than answered as an empty turn.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (null only for assistant)")
        if isinstance(self.content, list) and not self.content:  # as OpenAI: at least one part
            raise ValueError(f"a {self.role} message's content list is empty")
        return self

    def text(self) -> str:
        return "" if self.content is None else parts_text(self.content, "part")


class StreamOptions(Strict):
    include_usage: bool = False


class _Common(Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="extension: keep the k likeliest tokens")
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    top_logprobs: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("n must be 1 (one choice per request)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stops([value] if isinstance(value, str) else (value or []), "stop strings")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> _Common:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.logprobs not in (None, False, 0) or self.top_logprobs not in (None, 0):
            raise ValueError("logprobs and top_logprobs are not supported")
        if self.stream_options is not None and not self.stream:  # as OpenAI answers it
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None  # the older spelling of tools
    response_format: Any = None
    tool_choice: Any = None
    function_call: Any = None  # the older spelling of tool_choice

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("functions (tools) are not supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        # Constrained output (JSON mode, schemas) would change what is generated: refused.
        if value is not None and value != {"type": "text"}:
            raise ValueError('only response_format {"type": "text"} is supported')
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        for name in ("tool_choice", "function_call"):  # "required" with no tools cannot be met
            if getattr(self, name) not in (None, "none"):
                raise ValueError(f"{name} is not supported (no tools are served)")
        return self

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        # "developer" is the newer name for "system"; chat templates know only the latter.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        for text in value if isinstance(value, list) else [value]:
            utf8_text(text)  # token ids pass through
        return value

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo or self.suffix or (self.best_of not in (None, 1)):
            raise ValueError("echo, suffix and best_of are not supported")
        if self._batched and len(self.prompt) != 1:
            raise ValueError("one prompt per request (a list must hold exactly one)")
        return self

    @property
    def _batched(self) -> bool:
        """A list of prompts (strings or token lists) rather than one prompt."""
        p = self.prompt
        return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))

    def single_prompt(self) -> str | list[int]:
        return self.prompt[0] if self._batched else self.prompt  # type: ignore[return-value]

    @property
    def budget(self) -> int | None:
        return self.max_tokens


# -- responses ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(done: Finished) -> dict[str, Any]:
    completion = done.result.num_tokens
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": done.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": done.prefix_cached_tokens},
    }


def chat_response(model: str, done: Finished) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.result.text},
                "logprobs": None,
                "finish_reason": done.result.finish_reason,
            }
        ],
        "usage": usage(done),
        "dspark_flow": done.extension(),
    }


def completion_response(model: str, done: Finished) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": done.result.text,
                "logprobs": None,
                "finish_reason": done.result.finish_reason,
            }
        ],
        "usage": usage(done),
        "dspark_flow": done.extension(),
    }


async def stream(job: Job, model: str, *, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: (chat: a role chunk,) text chunks, a final chunk with finish_reason and the
    extension field, the usage chunk when asked for, then [DONE]."""
    head = {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update({"logprobs": None, "finish_reason": finish})
        return {**head, "choices": [choice]}

    if chat:
        yield sse(chunk(None, role=True))
    try:
        async for item in job.items():
            if isinstance(item, str):
                yield sse(chunk(item))
                continue
            final = chunk(None, finish=item.result.finish_reason)
            final["dspark_flow"] = item.extension()
            yield sse(final)
            if include_usage:
                yield sse(
                    {**head, "choices": [], "usage": usage(item), "dspark_flow": item.extension()}
                )
    except ApiError as exc:  # the status line has gone out: report in the stream
        yield sse(exc.openai_body())
    yield sse("[DONE]")
