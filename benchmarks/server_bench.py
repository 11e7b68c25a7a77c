"""Benchmark `dspark-flow serve` on loopback.

1. Time to first token of the second turn of a long conversation, with and without the prefix
   cache (two servers in this process around one loaded model; medians over --trials fresh
   conversations, each starting with a unique line so trials never reuse each other).
2. Throughput with --clients concurrent clients against the prefix-cache server: a bounded
   number of requests (--requests) and wall time (--time-limit).

    python benchmarks/server_bench.py [--recipe recipes/lookup.yaml] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from dspark_flow.server.app import create_app
from dspark_flow.server.config import ServerConfig, build_pipeline
from dspark_flow.server.engine import Engine
from dspark_flow.server.runner import BackgroundServer

REPO = Path(__file__).resolve().parent.parent
COLORS = ["red", "green", "blue", "amber", "violet", "grey", "white", "black"]
ANIMALS = ["otter", "heron", "badger", "lynx", "salmon", "beetle", "falcon", "newt", "ibex"]
PLACES = ["a river delta", "the high moor", "a pine forest", "the salt marsh", "a chalk cliff"]
TOPICS = ["rivers", "volcanoes", "bread", "bicycles", "owls", "glass", "tides", "maps"]


def document(items: int, nonce: int) -> str:
    """A long, varied, deterministic field report (about 20 tokens per item)."""
    lines = [f"Field report {nonce}. Read it carefully; questions follow."]
    for i in range(items):
        lines.append(
            f"Item {i + 1}: the {COLORS[(i * 3 + nonce) % len(COLORS)]} "
            f"{ANIMALS[(i * 5 + nonce) % len(ANIMALS)]} weighs {(i * 37 + nonce) % 90 + 5} kg "
            f"and was seen near {PLACES[(i * 7 + nonce) % len(PLACES)]}."
        )
    return "\n".join(lines)


def machine() -> str:
    """CPU model and core count (and the load when it starts: shared machines skew timings)."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{platform.system()} {name}, {os.cpu_count()} cores"


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def start(embedded: Any, recipe: str, cache: str) -> tuple[Engine, BackgroundServer]:
    overrides = [] if cache == "prefix" else ["cache.kind=kv"]
    pipeline = build_pipeline(recipe, overrides, target=embedded)
    engine = Engine(pipeline, warmup=True).start()
    engine.wait_ready()
    config = ServerConfig.for_recipe(pipeline.recipe)
    return engine, BackgroundServer(create_app(engine, config)).start()


def second_turn_ttft(
    client: openai.OpenAI, model: str, items: int, nonce: int
) -> tuple[float, dict[str, Any]]:
    """Run turn one, then stream turn two; seconds from sending turn two to its first text."""
    turn1 = [
        {"role": "user", "content": document(items, nonce) + "\n\nWhich item is the heaviest?"}
    ]
    first = client.chat.completions.create(
        model=model, messages=turn1, max_tokens=16, temperature=0
    )
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And which animals were seen near the salt marsh?"},
    ]
    sent = time.perf_counter()
    ttft = None
    figures: dict[str, Any] = {}
    stream = client.chat.completions.create(
        model=model, messages=turn2, max_tokens=8, temperature=0, stream=True
    )
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - sent
        figures = (chunk.model_extra or {}).get("dspark_flow", figures)
    return (ttft if ttft is not None else float("nan")), figures


def concurrent_throughput(
    url: str, model: str, clients: int, requests: int, max_tokens: int, time_limit: float
) -> dict[str, Any]:
    lock = threading.Lock()
    issued = 0
    latencies: list[float] = []
    queue_waits: list[float] = []
    tokens = 0
    failures = 0
    deadline = time.perf_counter() + time_limit

    def worker(index: int) -> None:
        nonlocal issued, tokens, failures
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                if issued >= requests or time.perf_counter() > deadline:
                    return
                issued += 1
                n = issued
            topic = TOPICS[(n + index) % len(TOPICS)]
            started = time.perf_counter()
            try:
                resp = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Write two sentences about {topic}."}],
                    max_tokens=max_tokens,
                    temperature=0,
                )
            except openai.OpenAIError:
                with lock:
                    failures += 1
                continue
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens += resp.usage.completion_tokens
                queue_waits.append((resp.model_extra or {})["dspark_flow"]["queue_seconds"])

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    ordered = sorted(latencies)
    return {
        "clients": clients,
        "completed": len(latencies),
        "failed": failures,
        "wall_seconds": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_sec": round(tokens / wall, 2) if wall > 0 else 0.0,
        "requests_per_sec": round(len(latencies) / wall, 3) if wall > 0 else 0.0,
        "latency_median_s": round(statistics.median(ordered), 2) if ordered else None,
        "latency_max_s": round(ordered[-1], 2) if ordered else None,
        "queue_wait_median_s": round(statistics.median(queue_waits), 2) if queue_waits else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default=str(REPO / "recipes" / "lookup.yaml"))
    p.add_argument("--trials", type=int, default=3, help="conversations per cache setting")
    p.add_argument(
        "--doc-items", type=int, default=80, help="length of the first turn (~20 tok each)"
    )
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests in the concurrency phase")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per concurrency request")
    p.add_argument("--time-limit", type=float, default=240.0, help="seconds for that phase")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from dspark_flow.api import load_target

    embedded = load_target()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "load_average_at_start": load_average(),
        "recipe": args.recipe,
        "doc_items": args.doc_items,
        "trials": args.trials,
    }
    servers = {name: start(embedded, args.recipe, name) for name in ("prefix", "kv")}
    try:
        for name, (engine, server) in servers.items():
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            model = ServerConfig.for_recipe(engine.pipeline.recipe).model_id
            ttfts, cached, prompts = [], [], []
            for trial in range(args.trials):
                ttft, figures = second_turn_ttft(client, model, args.doc_items, nonce=trial + 1)
                ttfts.append(ttft)
                cached.append(figures.get("prefix_cached_tokens", 0))
                prompts.append(figures.get("prompt_tokens", 0))
                print(
                    f"  {name:6s} trial {trial + 1}: second-turn TTFT {ttft:.3f}s, "
                    f"prompt {prompts[-1]} tokens, {cached[-1]} from the prefix cache",
                    file=sys.stderr,
                )
            results[f"ttft_{name}"] = {
                "median_s": round(statistics.median(ttfts), 3),
                "all_s": [round(t, 3) for t in ttfts],
                "prompt_tokens": int(statistics.median(prompts)),
                "prefix_cached_tokens": int(statistics.median(cached)),
            }
        results["ttft_speedup"] = round(
            results["ttft_kv"]["median_s"] / results["ttft_prefix"]["median_s"], 2
        )
        engine, server = servers["prefix"]
        model = ServerConfig.for_recipe(engine.pipeline.recipe).model_id
        print(f"  concurrency: {args.clients} clients, {args.requests} requests", file=sys.stderr)
        results["concurrent"] = concurrent_throughput(
            server.url, model, args.clients, args.requests, args.max_tokens, args.time_limit
        )
        results["concurrent"]["max_tokens"] = args.max_tokens
        results["health"] = httpx.get(f"{server.url}/health", timeout=10).json()
        results["load_average_at_end"] = load_average()
    finally:
        for engine, server in servers.values():
            server.stop()
            engine.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
