"""cache `prefix`: the `kv` cache plus reuse of earlier generations' KV entries.

When a generation ends, the KV arrays of everything the cache holds are stored, keyed by those
token ids. A new prompt starts from a copy of the stored entry with the longest common prefix, so
only the rest of the prompt is prefilled (a chat's second turn re-reads only the new message).
Entries are bounded by bytes (the sum of the stored arrays' nbytes) and evicted least recently
used first. Reuse never changes the output: the copied keys and values are the ones the target
computed for exactly those tokens at those positions.

Anything going wrong here falls back to a fresh cache: the cache is an optimisation and must never
fail a generation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache
from pydantic import Field

from dspark_flow.log import get_logger
from dspark_flow.strategies.caches.kv import KVCacheStrategy
from dspark_flow.strategy import BuildContext, StrategyConfig

log = get_logger()

MiB = 2**20


class PrefixCacheConfig(StrategyConfig):
    kind: Literal["prefix"] = "prefix"
    max_bytes: int = Field(512 * MiB, ge=0, description="most bytes of stored KV arrays (LRU)")
    min_tokens: int = Field(1, ge=1, description="shortest common prefix worth reusing")
    max_active_bytes: int | None = Field(
        None,
        ge=0,
        description="evict entries before a request while MLX's active memory is above this",
    )


@dataclass
class _Entry:
    tokens: np.ndarray  # int64 token ids the arrays hold, in order
    layers: list[tuple[mx.array, mx.array]]  # per layer (keys, values), exactly len(tokens) long
    nbytes: int


def _copy(x: mx.array) -> mx.array:
    # A distinct, compact array: KVCache.update_and_fetch slice-assigns into its own arrays, so
    # the stored entry and a live cache must never be the same array object (MLX never writes
    # into a buffer that another array still references, so sharing a buffer is safe).
    return mx.contiguous(x)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def active_memory_probe() -> Callable[[], int] | None:
    """MLX's active-memory counter where this build reports one (names moved across versions)."""
    for owner in (mx, getattr(mx, "metal", None)):
        fn = getattr(owner, "get_active_memory", None)
        if callable(fn):
            return fn
    return None


def default_memory_ceiling(fraction: float = 0.9) -> int | None:
    """A share of MLX's memory limit (the device's working set), where MLX reports one."""
    for owner in (mx, getattr(mx, "metal", None)):
        fn = getattr(owner, "get_memory_limit", None)
        if callable(fn):
            try:
                limit = int(fn())
            except Exception:
                return None
            return int(limit * fraction) if limit > 0 else None
    return None


def _release_freed_buffers() -> None:
    # Freed arrays go to MLX's buffer pool first; hand them back so the process really shrinks.
    for owner in (mx, getattr(mx, "metal", None)):
        fn = getattr(owner, "clear_cache", None)
        if callable(fn):
            fn()
            return


class PrefixCacheStrategy(KVCacheStrategy):
    Config = PrefixCacheConfig  # type: ignore[assignment]  # a narrower section than the base's
    config: PrefixCacheConfig

    def __init__(self, config: PrefixCacheConfig | None = None):
        super().__init__(config)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._next_key = 0
        self._lock = threading.Lock()  # /health reads stats while the worker generates
        self._usable = True
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.evictions = 0
        self.reused_tokens = 0
        self.errors = 0
        self.last_reused = 0  # prompt tokens the latest `new` took from the store

    def warm_up(self, ctx: BuildContext) -> None:
        super().warm_up(ctx)
        # Copying and trimming is written for mlx-lm's plain KVCache; other layer caches
        # (rotating windows, quantized, recurrent) run uncached rather than risk wrong output.
        layers = make_prompt_cache(ctx.model)
        self._usable = all(type(layer) is KVCache for layer in layers)
        if not self._usable:
            kinds = sorted({type(layer).__name__ for layer in layers})
            log.warning("prefix reuse disabled", reason=f"layer caches {kinds} are not KVCache")

    # -- the slot contract -------------------------------------------------------------------

    def new(self, model: nn.Module, prompt_ids: list[int]) -> tuple[list[Any], int]:
        self.last_reused = 0
        cache = make_prompt_cache(model)
        if not self._usable or not self._entries:
            self.misses += 1
            return cache, 0
        try:
            with self._lock:
                found = self._longest(np.asarray(prompt_ids, dtype=np.int64))
                if found is None:
                    self.misses += 1
                    return cache, 0
                key, entry, common = found
                # At least one prompt token must be run to get logits for the first new token.
                n = min(common, len(prompt_ids) - 1)
                if n < self.config.min_tokens or len(entry.layers) != len(cache):
                    self.misses += 1
                    return cache, 0
                self._entries.move_to_end(key)
                for layer, (keys, values) in zip(cache, entry.layers, strict=True):
                    layer.keys = _copy(keys[..., :n, :])
                    layer.values = _copy(values[..., :n, :])
                    layer.offset = n
            mx.eval([(layer.keys, layer.values) for layer in cache])
        except Exception as exc:  # never fail a generation because of the cache
            self.errors += 1
            log.warning("prefix cache lookup failed; starting fresh", error=repr(exc))
            return make_prompt_cache(model), 0
        self.hits += 1
        self.reused_tokens += n
        self.last_reused = n
        return cache, n

    def finish(self, cache: list[Any], token_ids: list[int]) -> None:
        if not self._usable or self.config.max_bytes <= 0:
            return
        try:
            self._store(cache, token_ids)
        except Exception as exc:
            self.errors += 1
            log.warning("prefix cache store failed; entry dropped", error=repr(exc))

    # -- store -------------------------------------------------------------------------------

    def _longest(self, prompt: np.ndarray) -> tuple[int, _Entry, int] | None:
        best: tuple[int, _Entry, int] | None = None
        for key, entry in self._entries.items():
            common = _common_prefix(entry.tokens, prompt)
            # Ties go to the most recently used entry (later in the order).
            if common > 0 and (best is None or common >= best[2]):
                best = (key, entry, common)
        return best

    def _store(self, cache: Sequence[Any], token_ids: Sequence[int]) -> None:
        if not cache or not all(type(layer) is KVCache for layer in cache):
            return
        # The loop may have cut committed tokens after a stop token while the cache still holds
        # them; what `token_ids` names is a prefix of what the cache holds.
        n = min([len(token_ids)] + [layer.offset for layer in cache])
        if n < self.config.min_tokens or any(layer.keys is None for layer in cache):
            return
        tokens = np.asarray(token_ids[:n], dtype=np.int64)
        layers = [
            (_copy(layer.keys[..., :n, :]), _copy(layer.values[..., :n, :])) for layer in cache
        ]
        mx.eval(layers)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.config.max_bytes:
            return  # larger than the whole budget: storing it would only flush everything else
        with self._lock:
            for key, entry in list(self._entries.items()):
                common = _common_prefix(entry.tokens, tokens)
                if common == len(tokens):
                    # Already covered by an entry at least this long: just mark it used.
                    self._entries.move_to_end(key)
                    return
                if common == len(entry.tokens):
                    # The new entry extends this one (the next turn of a chat): drop the old.
                    self._drop(key)
            self._entries[self._next_key] = _Entry(tokens=tokens, layers=layers, nbytes=nbytes)
            self._next_key += 1
            self.bytes += nbytes
            self.stores += 1
            while self.bytes > self.config.max_bytes and len(self._entries) > 1:
                self._evict_oldest()

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes

    def _evict_oldest(self) -> None:
        key = next(iter(self._entries))
        self._drop(key)
        self.evictions += 1

    # -- management --------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every entry and the counters (e.g. after a warm-up generation)."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0
            self.hits = self.misses = self.stores = self.evictions = 0
            self.reused_tokens = self.errors = self.last_reused = 0
        _release_freed_buffers()

    def relieve_memory(self, ceiling: int | None = None) -> int:
        """Evict entries (oldest first) while MLX reports more active memory than `ceiling`
        (default: the config's `max_active_bytes`); returns how many were evicted."""
        ceiling = self.config.max_active_bytes if ceiling is None else ceiling
        probe = active_memory_probe()
        if ceiling is None or probe is None:
            return 0
        evicted = 0
        try:
            with self._lock:
                while self._entries and int(probe()) > ceiling:
                    self._evict_oldest()
                    evicted += 1
                    _release_freed_buffers()
        except Exception as exc:
            self.errors += 1
            log.warning("memory guard failed", error=repr(exc))
        if evicted:
            log.info("memory guard evicted prefix entries", evicted=evicted, ceiling=ceiling)
        return evicted

    def stats(self) -> dict[str, Any]:
        with self._lock:
            entries = len(self._entries)
            tokens = sum(len(e.tokens) for e in self._entries.values())
        return {
            "kind": "prefix",
            "enabled": self._usable,
            "entries": entries,
            "tokens": tokens,
            "bytes": self.bytes,
            "max_bytes": self.config.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "stores": self.stores,
            "evictions": self.evictions,
            "reused_tokens": self.reused_tokens,
            "last_reused": self.last_reused,
            "errors": self.errors,
        }
