"""Anthropic Messages-compatible request model and response/SSE builders.

Only text content is served. A final assistant message is a prefill: the answer continues it.
Usage follows Anthropic's convention: `input_tokens` counts the prompt tokens that were run,
`cache_read_input_tokens` those taken from the prefix cache (their sum is the prompt length).
A stream reports the whole prompt as `input_tokens` in message_start (the split is known only at
the end) and the split in message_delta, whose usage the SDKs copy over message_start's.
"""

from __future__ import annotations

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

Block = TextPart  # Anthropic's name for a piece of content


def _blocks_text(content: str | list[Block]) -> str:
    return parts_text(content, "block")


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        if isinstance(value, list):  # other block types refused here, where the 400 names them
            _blocks_text(value)
        return utf8_text(value)


def _check_content(messages: list[Message], system: Any, tools: Any, tool_choice: Any) -> None:
    """What /v1/messages and count_tokens both refuse: 400s, not a 500 from encoding later."""
    if tools:
        raise ValueError("tools are not supported")
    if tool_choice is not None and tool_choice != {"type": "none"}:
        raise ValueError("tool_choice is not supported (no tools are served)")
    if system is not None:  # named here: the prompt puts it first, before messages[0]
        utf8_text(_blocks_text(system), "system")
    for i, message in enumerate(messages):
        text = _blocks_text(message.content)
        prefill = i == len(messages) - 1 and message.role == "assistant"
        if not text and not prefill:  # Anthropic refuses an empty turn but an empty prefill
            raise ValueError(f"messages[{i}].content must not be empty")


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: Any) -> Any:
        if value is not None and not (isinstance(value, dict) and value.get("type") == "disabled"):
            raise ValueError("extended thinking is not supported")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        check_stops(value or [], "stop sequences")
        return value

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        _check_content(self.messages, self.system, self.tools, self.tool_choice)
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        out = []
        if self.system:
            out.append({"role": "system", "content": _blocks_text(self.system)})
        out += [{"role": m.role, "content": _blocks_text(m.content)} for m in self.messages]
        return out


class CountTokensRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check(self) -> CountTokensRequest:
        _check_content(self.messages, self.system, self.tools, self.tool_choice)
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        request = MessagesRequest.model_construct(
            model=self.model, max_tokens=1, messages=self.messages, system=self.system
        )
        return MessagesRequest.chat_messages(request)


# -- responses ---------------------------------------------------------------------------------


def stop_reason(done: Finished) -> str:
    if done.result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


def usage(done: Finished) -> dict[str, Any]:
    return {
        "input_tokens": done.prompt_tokens - done.prefix_cached_tokens,
        "cache_read_input_tokens": done.prefix_cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": done.result.num_tokens,
    }


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_response(model: str, done: Finished) -> dict[str, Any]:
    return {
        "id": new_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": done.result.text}],
        "stop_reason": stop_reason(done),
        "stop_sequence": done.stop_sequence,
        "usage": usage(done),
        "dspark_flow": done.extension(),
    }


async def stream(job: Job, model: str, prompt_tokens: int) -> AsyncIterator[str]:
    """message_start, content_block_start, ping, text deltas, content_block_stop,
    message_delta (stop_reason, usage, extension field), message_stop."""
    start: dict[str, Any] = {
        "id": new_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        # How much came from the prefix cache is known only at the end: message_delta's
        # usage (cumulative; the SDKs copy it over this one) gives the split.
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }
    yield sse({"type": "message_start", "message": start}, "message_start")
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    yield sse(block, "content_block_start")
    yield sse({"type": "ping"}, "ping")
    try:
        async for item in job.items():
            if isinstance(item, str):
                delta = {"type": "text_delta", "text": item}
                yield sse(
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                    "content_block_delta",
                )
                continue
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            delta_event = {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(item), "stop_sequence": item.stop_sequence},
                "usage": usage(item),
                "dspark_flow": item.extension(),
            }
            yield sse(delta_event, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
    except ApiError as exc:  # the status line has gone out: report in the stream
        yield sse(exc.anthropic_body(), "error")
