"""`dspark-flow serve` end to end: a live uvicorn server on a free loopback port, the embedded
model with the lookup recipe, driven through the real `openai` and `anthropic` clients (and raw
httpx for the bad requests a client library would refuse to send)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from dspark_flow.server.app import create_app
from dspark_flow.server.config import ServerConfig, build_pipeline, server_overrides
from dspark_flow.server.engine import Engine
from dspark_flow.server.runner import BackgroundServer

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "lookup.yaml"
KEY = "test-key"
MODEL = "lookup"  # the recipe's name
BODY_LIMIT = 64 * 1024
SHORT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]  # ends by itself
TALK = [{"role": "user", "content": "Tell me about the moon."}]


@pytest.fixture(scope="module")
def server(embedded):
    pipeline = build_pipeline(RECIPE, target=embedded)
    engine = Engine(pipeline, warmup=True).start()
    engine.wait_ready(timeout=300)
    config = ServerConfig.for_recipe(pipeline.recipe, api_key=KEY, max_body_bytes=BODY_LIMIT)
    with BackgroundServer(create_app(engine, config)) as running:
        yield running
    engine.stop()


def test_server_pipelines_take_the_probed_kernels_verifier():
    # Like the CLI, the server fills in the kernels verifier where the recipe names none.
    assert build_pipeline(RECIPE).recipe.verifier.kind == "kernels"
    explicit = build_pipeline(RECIPE, ["verifier={kind: reference}"])
    assert explicit.recipe.verifier.kind == "reference"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def ext(obj) -> dict:
    """The `dspark_flow` extension field of a client response object."""
    extra = obj.model_extra or {}
    assert "dspark_flow" in extra, "the response lacks the dspark_flow field"
    return extra["dspark_flow"]


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


# -- plumbing ----------------------------------------------------------------------------------


def test_health_and_models(server, oai):
    h = health(server)
    assert h["ready"] and h["model"] == MODEL and h["mode"] == "lookup"
    assert h["cache"]["kind"] == "prefix" and h["target"] == "builtin:smollm2-135m"
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert oai.models.retrieve("builtin:smollm2-135m").id == MODEL  # the target ref is an alias
    first = oai.models.list().data[0].created
    time.sleep(1.1)
    assert oai.models.retrieve(MODEL).created == first  # when serving began, not the request's


def test_a_trailing_slash_is_an_unknown_path_not_a_redirect(server):
    r = httpx.post(f"{server.url}/v1/chat/completions/", json=GOOD_CHAT, headers=BEARER)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages/", json=GOOD_MSG, headers=XKEY)
    assert r.status_code == 404 and r.json()["type"] == "error"


def test_prefix_cache_is_the_default_unless_the_user_picks_one():
    assert server_overrides([], 1024, None) == ["cache={kind: prefix, max_bytes: 1024}"]
    assert server_overrides(["cache.kind=kv"], 1024, None) == ["cache.kind=kv"]


def test_a_recipes_own_prefix_cache_keeps_its_settings(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        RECIPE.read_text() + "\ncache: {kind: prefix, max_bytes: 1000, min_tokens: 8}\n"
    )
    kept = build_pipeline(recipe).recipe.cache
    assert (kept.kind, kept.max_bytes, kept.min_tokens) == ("prefix", 1000, 8)
    sized = build_pipeline(recipe, cache_bytes=4096).recipe.cache  # the flag, given, refines it
    assert (sized.max_bytes, sized.min_tokens) == (4096, 8)
    kv = tmp_path / "kv.yaml"
    kv.write_text(RECIPE.read_text() + "\ncache: {kind: kv}\n")
    assert build_pipeline(kv).recipe.cache.kind == "prefix"  # serving swaps a plain KV cache


def test_cli_help_does_not_import_the_server_stack():
    code = (
        "import sys; from dspark_flow.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'mlx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_cli_reports_a_taken_port_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "dspark_flow", "serve", str(RECIPE), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 2, run.stderr
    assert (
        run.stderr.startswith("error: cannot listen on 127.0.0.1:")
        and "Traceback" not in run.stderr
    )


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--api-key", ""], {}, "API key"),
        ([], {"DSPARK_FLOW_API_KEY": " "}, "API key"),
        (["--host", ""], {}, "--host is empty"),
    ],
)
def test_cli_refuses_an_empty_api_key_or_host(args, env, words):
    # `--api-key "$KEY"` with KEY unset must not serve without a key.
    run = subprocess.run(
        [sys.executable, "-m", "dspark_flow", "serve", str(RECIPE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_cli_reports_a_model_that_fails_to_load_once(tmp_path):
    from dspark_flow.models.embedded import ensure_builtin

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ensure_builtin("smollm2-135m", progress=False).iterdir():
        data = f.read_bytes() if f.is_file() else None
        if data is not None:  # the weights cut short: loading fails after the checks pass
            (broken / f.name).write_bytes(data[:1000] if f.suffix == ".safetensors" else data)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\ntarget: {{model: {broken}}}\n")
    run = subprocess.run(
        [sys.executable, "-m", "dspark_flow", "serve", str(recipe), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1 and lines[0].startswith("error: could not load model"), run.stderr


def test_cli_serves_with_the_environment_key_and_exits_cleanly_on_ctrl_c():
    """The key in $DSPARK_FLOW_API_KEY is required. The engine thread ran MLX work; streams it
    leaves to interpreter exit abort the process (exit 134, "terminate called without an
    active exception")."""
    import json
    import signal
    import urllib.error
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_flow", "serve", str(RECIPE), "--port", "0", "--no-warmup"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DSPARK_FLOW_API_KEY": "key-from-env"},
    )
    try:
        lines = []
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("serving "):
                break
        url = lines[-1].split(" on ")[-1].strip()
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
        headers = {"content-type": "application/json"}
        request = urllib.request.Request(url + "/completions", body, headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=120)
        assert refused.value.code == 401
        headers["authorization"] = "Bearer key-from-env"
        request = urllib.request.Request(url + "/completions", body, headers)
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode in (0, 130), "".join(lines) + rest  # 130: the CLI's code for Ctrl-C
    assert "terminate called" not in rest


# -- OpenAI ------------------------------------------------------------------------------------


def test_chat_non_streaming_and_streaming_agree(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=TALK, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    figures = ext(resp)
    assert figures["completion_tokens"] == 8 and figures["num_rounds"] >= 1
    assert {"mean_accept_len", "decode_tokens_per_sec", "tokens_per_sec", "ttft_seconds"} <= set(
        figures
    )

    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=TALK,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy, with the prompt now from the prefix cache
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert ext(finals[0])["completion_tokens"] == 8
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert ext(chunks[-1])["prefix_cached_tokens"] > 0


def test_chat_ends_by_itself_with_stop(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=24, temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert 0 < resp.usage.completion_tokens < 24


def test_target_ref_is_accepted_as_model(oai):
    resp = oai.chat.completions.create(
        model="builtin:smollm2-135m", messages=SHORT, max_completion_tokens=4, temperature=0
    )
    assert resp.usage.completion_tokens <= 4


def test_completions(oai):
    resp = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
    stream = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    assert ext(chunks[-1])["completion_tokens"] == 6
    ids = oai.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_stop_strings(oai):
    full = oai.chat.completions.create(model=MODEL, messages=TALK, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    word = text.split()[2]  # a stop string from the middle of the known greedy output
    cut = oai.chat.completions.create(
        model=MODEL, messages=TALK, max_tokens=8, temperature=0, stop=["@@none@@", word]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(word)]


def test_seeded_sampling_is_reproducible(oai):
    kwargs = dict(model=MODEL, messages=TALK, max_tokens=6, temperature=0.9, seed=7)
    a = oai.chat.completions.create(**kwargs, extra_body={"top_k": 40, "min_p": 0.05})
    b = oai.chat.completions.create(**kwargs, extra_body={"top_k": 40, "min_p": 0.05})
    assert a.choices[0].message.content == b.choices[0].message.content


def test_two_turn_conversation_reuses_the_prefix(oai):
    turn1 = [{"role": "user", "content": "Name a large animal that lives in the sea."}]
    first = oai.chat.completions.create(model=MODEL, messages=turn1, max_tokens=10, temperature=0)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "How big does it get?"},
    ]
    second = oai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, temperature=0)
    reused = ext(second)["prefix_cached_tokens"]
    assert reused >= first.usage.prompt_tokens  # at least the whole first prompt
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    assert reused < second.usage.prompt_tokens


# -- Anthropic ---------------------------------------------------------------------------------


def test_messages_non_streaming(claude):
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=TALK,
        system="You are terse.",
        extra_body={"temperature": 0},
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8
    assert msg.content[0].type == "text" and msg.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, messages=TALK, system="You are terse.")
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert ext(msg)["completion_tokens"] == 8

    ended = claude.messages.create(model=MODEL, max_tokens=24, messages=SHORT)
    assert ended.stop_reason == "end_turn" and ended.stop_sequence is None


def test_messages_streaming_and_stop_sequence(server, claude):
    system = [{"type": "text", "text": "You are terse."}]
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=TALK, system=system) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == final.content[0].text and pieces
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    # Again, the prompt now in the prefix cache: message_delta's usage carries the split, and
    # the SDK's final usage sums to the same prompt length.
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=TALK, system=system) as s:
        again = s.get_final_message()
    prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert again.usage.cache_read_input_tokens > 0

    word = final.content[0].text.split()[2]
    blocks = [{"role": "user", "content": [{"type": "text", "text": TALK[0]["content"]}]}]
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=blocks, system=system, stop_sequences=[word]
    ) as s:
        cut = s.get_final_message()
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == final.content[0].text[: final.content[0].text.index(word)]

    raw = httpx.post(  # the event sequence itself
        f"{server.url}/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": MODEL, "max_tokens": 3, "messages": SHORT, "stream": True},
        timeout=60,
    )
    events = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta"}
    assert '"dspark_flow"' in raw.text.split("event: message_delta")[1]


# -- bad requests ------------------------------------------------------------------------------

GOOD_CHAT = {"model": MODEL, "messages": SHORT, "max_tokens": 2}
GOOD_MSG = {"model": MODEL, "messages": SHORT, "max_tokens": 2}
BEARER = {"Authorization": f"Bearer {KEY}"}
XKEY = {"x-api-key": KEY}

OPENAI_CASES = [
    ("invalid json", "/v1/chat/completions", BEARER, b"{not json", 400, None),
    ("not an object", "/v1/chat/completions", BEARER, b"[1, 2]", 400, None),
    ("missing messages", "/v1/chat/completions", BEARER, {"model": MODEL}, 400, "messages"),
    ("missing model", "/v1/chat/completions", BEARER, {"messages": SHORT}, 400, "model"),
    (
        "wrong type",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "max_tokens": "2"},
        400,
        "max_tokens",
    ),
    (
        "negative max",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "zero max",
        "/v1/completions",
        BEARER,
        {"model": MODEL, "prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
    ),
    ("n > 1", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "n": 2}, 400, "n"),
    (
        "lone surrogate, completion",
        "/v1/completions",
        BEARER,
        b'{"model": "lookup", "prompt": "ab\\ud800", "max_tokens": 2}',
        400,
        "prompt",
    ),
    (
        "lone surrogate, chat",
        "/v1/chat/completions",
        BEARER,
        b'{"model": "lookup", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages[0].content",
    ),
    (  # the part named, not only its message
        "lone surrogate, text part",
        "/v1/chat/completions",
        BEARER,
        b'{"model": "lookup", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\\udfff"}]}]}',
        400,
        "messages[0].content[1].text",
    ),
    (
        "image part",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "messages": [*SHORT, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[1].content",
    ),
    (
        "json mode",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "functions",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "functions": [{"name": "f", "parameters": {}}]},
        400,
        "functions",
    ),
    (
        "bad role",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "messages": [{"role": "x", "content": "a"}]},
        400,
        "messages[0].role",
    ),
    (
        "user content null",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "messages": [{"role": "user", "content": None}]},
        400,
        "messages[0]",
    ),
    ("empty stop", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "stop": [""]}, 400, "stop"),
    ("bad top_p", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "top_p": 0}, 400, "top_p"),
    ("stream_options alone", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "stream_options": {"include_usage": True}}, 400, None),
    ("33 stops", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "stop": [f"s{i}" for i in range(33)]}, 400, "stop"),
    ("long stop", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "stop": "x" * 1001}, 400, "stop"),
    ("empty content list", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "messages": [{"role": "user", "content": []}]}, 400, None),
    (
        "unknown model",
        "/v1/chat/completions",
        BEARER,
        {**GOOD_CHAT, "model": "gpt-9"},
        404,
        "model",
    ),
    ("wrong key", "/v1/chat/completions", {"Authorization": "Bearer nope"}, GOOD_CHAT, 401, None),
    ("no key", "/v1/chat/completions", {}, GOOD_CHAT, 401, None),
    ("key without Bearer", "/v1/chat/completions", {"Authorization": KEY}, GOOD_CHAT, 401, None),
    ("top_logprobs", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "top_logprobs": 5}, 400, None),
    ("oversize", "/v1/chat/completions", BEARER, {**GOOD_CHAT, "pad": "x" * BODY_LIMIT}, 413, None),
    ("no route", "/v1/nothing", BEARER, GOOD_CHAT, 404, None),
    # Found by the server audit of 2026-12-03: a 500, or a parameter dropped unseen.
    ("lone surrogate, model", "/v1/chat/completions", BEARER,
     b'{"model": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}', 404, "model"),
    ("lone surrogate, stop", "/v1/chat/completions", BEARER,
     b'{"model": "lookup", "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\ud800"]}', 400, "stop"),
    ("assistant tool calls", "/v1/chat/completions", BEARER,
     {**GOOD_CHAT, "messages": [*SHORT, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages[1]"),
    ("tool_choice without tools", "/v1/chat/completions", BEARER,
     {**GOOD_CHAT, "tool_choice": "required"}, 400, None),
]  # fmt: skip

ANTHROPIC_CASES = [
    ("invalid json", XKEY, b"{", 400, "invalid_request_error"),
    ("missing max_tokens", XKEY, {"model": MODEL, "messages": SHORT}, 400, "invalid_request_error"),
    ("negative max", XKEY, {**GOOD_MSG, "max_tokens": -5}, 400, "invalid_request_error"),
    (
        "wrong content",
        XKEY,
        {**GOOD_MSG, "messages": [{"role": "user", "content": 5}]},
        400,
        "invalid_request_error",
    ),
    (
        "image block",
        XKEY,
        {**GOOD_MSG, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        400,
        "invalid_request_error",
    ),
    (
        "thinking",
        XKEY,
        {**GOOD_MSG, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        400,
        "invalid_request_error",
    ),
    ("unknown model", XKEY, {**GOOD_MSG, "model": "claude-x"}, 404, "not_found_error"),
    ("wrong key", {"x-api-key": "nope"}, GOOD_MSG, 401, "authentication_error"),
    ("oversize", XKEY, {**GOOD_MSG, "pad": "x" * BODY_LIMIT}, 413, "request_too_large"),
    ("lone surrogate, model", XKEY,
     b'{"model": "\\udc80", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}', 404, "not_found_error"),
    ("lone surrogate, stop", XKEY, b'{"model": "lookup", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "stop_sequences": ["\\ud800"]}', 400, "invalid_request_error"),
    ("empty content", XKEY, {**GOOD_MSG, "messages": [{"role": "user", "content": []}]}, 400, "invalid_request_error"),
    ("empty text", XKEY, {**GOOD_MSG, "messages": [{"role": "user", "content": ""}]}, 400, "invalid_request_error"),
    ("prefill alone", XKEY, {**GOOD_MSG, "messages": [{"role": "assistant", "content": "Hi"}]}, 400, "invalid_request_error"),
    ("33 stop sequences", XKEY, {**GOOD_MSG, "stop_sequences": [f"s{i}" for i in range(33)]}, 400, "invalid_request_error"),
    ("tool_choice without tools", XKEY, {**GOOD_MSG, "tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
]  # fmt: skip


def _post(server, path: str, headers: dict, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, headers=headers, content=body, timeout=30)
    return httpx.post(server.url + path, headers=headers, json=body, timeout=30)


@pytest.mark.parametrize(("name", "path", "headers", "body", "status", "param"), OPENAI_CASES)
def test_openai_bad_requests(server, name, path, headers, body, status, param):
    r = _post(server, path, headers, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(("name", "headers", "body", "status", "kind"), ANTHROPIC_CASES)
def test_anthropic_bad_requests(server, name, headers, body, status, kind):
    r = _post(server, "/v1/messages", headers, body)
    assert r.status_code == status, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == kind and data["error"]["message"]


def test_anthropic_names_the_system_prompt_it_refuses(server):
    # Found by the server audit of 2026-12-05: blamed messages[0], where the prompt puts it.
    body = b'{"model": "lookup", "max_tokens": 2, "system": "\\udfff", "messages": [{"role": "user", "content": "Hi"}]}'
    r = _post(server, "/v1/messages", XKEY, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("system is not valid UTF-8") and "messages" not in message


@pytest.mark.parametrize(
    "body",
    [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"model": MODEL, "messages": SHORT, "system": [{"type": "image"}]},
        {"model": MODEL, "messages": SHORT, "tools": [{"name": "f", "input_schema": {}}]},
    ],
)
def test_count_tokens_refuses_what_messages_refuses(server, body):
    # Non-text blocks were a 500 there (checked only while encoding); tools were ignored.
    r = _post(server, "/v1/messages/count_tokens", XKEY, body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_wrong_methods_name_the_allowed_ones_and_health_answers_head(server):
    r = httpx.get(f"{server.url}/v1/chat/completions", headers=BEARER, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert httpx.head(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.head(f"{server.url}/v1/models", headers=BEARER, timeout=30).status_code == 200


def test_an_auth_header_without_its_scheme_is_named(server):
    r = _post(server, "/v1/chat/completions", {"Authorization": KEY}, GOOD_CHAT)
    assert r.status_code == 401 and "'Bearer KEY'" in r.json()["error"]["message"]


def test_client_library_sees_typed_errors(oai, claude):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=SHORT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=-3)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=str(claude.base_url), api_key="bad", max_retries=0
        ).messages.create(model=MODEL, max_tokens=2, messages=SHORT)


def test_an_over_long_prompt_is_a_400_without_a_tokenizer_warning(server):
    # The server answers it itself; transformers' "Token indices sequence length" warning
    # about the same prompt would only clutter the log.
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    transformers_log = logging.getLogger("transformers")
    transformers_log.addHandler(handler)
    try:
        body = {**GOOD_CHAT, "messages": [{"role": "user", "content": "hello " * 9000}]}
        r = _post(server, "/v1/chat/completions", BEARER, body)
    finally:
        transformers_log.removeHandler(handler)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert not [m for m in seen if "Token indices" in m]


# -- concurrency and cancellation --------------------------------------------------------------


def test_still_serving_after_bad_requests(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=3, temperature=0)
    assert resp.usage.completion_tokens <= 3


def test_requests_are_served_one_at_a_time_in_arrival_order(server, oai):
    done: list[int] = []
    waited: list[float] = []
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            resp = oai.chat.completions.create(
                model=MODEL, messages=TALK, max_tokens=16, temperature=0
            )
            done.append(i)
            waited.append(ext(resp)["queue_seconds"])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        # Arrival order 0, 1, 2, far apart next to a generation (16 tokens, ~0.7 s here): with
        # 0.3 s gaps and 8 tokens the queue wait fell to 0.049 s on a fast run and failed.
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=120)
    assert not errors and done == [0, 1, 2]
    assert max(waited) > 0.05  # a later request queued behind an earlier one


def _assert_next_request_is_prompt(server, oai, cancelled_before: int) -> None:
    started = time.perf_counter()
    resp = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=3, temperature=0)
    took = time.perf_counter() - started
    assert resp.usage.completion_tokens <= 3
    # The abandoned generation would have needed 300 tokens (tens of seconds here).
    assert took < 20, f"the next request waited {took:.1f}s"
    deadline = time.monotonic() + 5
    while health(server)["queue"]["cancelled"] <= cancelled_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(server)["queue"]["cancelled"] > cancelled_before


def test_streaming_disconnect_cancels_the_generation(server, oai):
    before = health(server)["queue"]["cancelled"]
    body = {"model": MODEL, "messages": TALK, "max_tokens": 300, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=BEARER, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                break  # some text arrived: now hang up
    _assert_next_request_is_prompt(server, oai, before)


def test_shutdown_ends_a_stream_with_an_error_event(embedded):
    """Ctrl-C / SIGTERM mid-stream: the client gets a 503 error event and [DONE], not a body cut
    off after uvicorn's grace period."""
    import signal

    pipeline = build_pipeline(RECIPE, target=embedded)
    engine = Engine(pipeline, warmup=False).start()
    engine.wait_ready(timeout=300)
    config = ServerConfig.for_recipe(pipeline.recipe, api_key=KEY)
    body = {"model": MODEL, "messages": TALK, "max_tokens": 300, "stream": True}
    lines = []
    try:
        with BackgroundServer(create_app(engine, config)) as running:
            url = f"{running.url}/v1/chat/completions"
            with httpx.stream("POST", url, json=body, headers=BEARER, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 3:  # text is flowing: the signal arrives
                        running.server.handle_exit(signal.SIGTERM, None)
    finally:
        engine.stop()
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]


def test_after_the_shutdown_began_requests_get_503_and_the_abort_takes_no_lock(embedded):
    """The shutdown's abort runs in a signal handler on the event loop's thread, which may sit
    inside the queue's own (non-reentrant) lock: taking it there hung the server for good."""
    pipeline = build_pipeline(RECIPE, target=embedded)
    engine = Engine(pipeline, warmup=False).start()
    engine.wait_ready(timeout=300)
    config = ServerConfig.for_recipe(pipeline.recipe, api_key=KEY)
    try:
        with BackgroundServer(create_app(engine, config)) as running:

            def abort_inside_the_lock() -> None:
                with engine._jobs.mutex:  # as if the signal landed inside submit()
                    engine.abort_all()

            worker = threading.Thread(target=abort_inside_the_lock, daemon=True)
            worker.start()
            worker.join(timeout=10)
            assert not worker.is_alive(), "abort_all blocked on the queue's lock"
            url = f"{running.url}/v1/chat/completions"
            late = httpx.post(url, json=GOOD_CHAT, headers=BEARER, timeout=30)
            assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    finally:
        engine.stop()


def test_a_full_queue_answers_429_in_each_dialect(embedded):
    pipeline = build_pipeline(RECIPE, target=embedded)
    engine = Engine(pipeline, warmup=False).start()
    engine.wait_ready(timeout=300)
    config = ServerConfig.for_recipe(pipeline.recipe, api_key=KEY, max_queue=0)  # none may wait
    body = {"model": MODEL, "messages": TALK, "max_tokens": 300, "stream": True}
    try:
        with BackgroundServer(create_app(engine, config)) as running:
            url = f"{running.url}/v1/chat/completions"
            with httpx.stream("POST", url, json=body, headers=BEARER, timeout=60) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the worker has taken it: it is busy
                assert engine.busy
                late = httpx.post(url, json=GOOD_CHAT, headers=BEARER, timeout=30)
                assert late.status_code == 429
                assert late.json()["error"]["code"] == "rate_limit_exceeded"
                late = httpx.post(f"{running.url}/v1/messages", json=GOOD_MSG, headers=XKEY)
                assert late.status_code == 429
                assert late.json()["error"]["type"] == "rate_limit_error"
            # The stream is gone: the worker frees itself and an idle server takes a request.
            deadline = time.monotonic() + 30
            while engine.busy and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.post(url, json=GOOD_CHAT, headers=BEARER, timeout=60).status_code == 200
    finally:
        engine.stop()


def test_non_streaming_disconnect_cancels_the_generation(server, oai):
    before = health(server)["queue"]["cancelled"]
    body = {"model": MODEL, "messages": TALK, "max_tokens": 300}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=BEARER, timeout=1.5)
    _assert_next_request_is_prompt(server, oai, before)


def test_a_body_cut_short_is_a_client_error_not_a_crash():
    """A client that hangs up mid-body must end as an ApiError (answered by its handler), not
    as Starlette's ClientDisconnect, which the catch-all handler would log as a traceback."""
    import asyncio

    from starlette.requests import Request

    from dspark_flow.server.common import ApiError, read_json

    messages = [
        {"type": "http.request", "body": b'{"model": "x", "mess', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive():
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_json(Request(scope, receive), BODY_LIMIT))
    assert caught.value.status == 400 and "closed the connection" in str(caught.value)


def test_still_serving_after_a_body_cut_short(server, oai, monkeypatch):
    import dspark_flow.server.app as app_module

    errors: list[tuple] = []

    class Recorder:  # the catch-all handler logs "request failed" (and Starlette a traceback)
        def error(self, *args, **kwargs):
            errors.append((args, kwargs))

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(app_module, "log", Recorder())
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
            b'{"model": "lookup", "mess'
        )
    reply = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=4)
    assert reply.choices[0].message.content
    assert errors == []
