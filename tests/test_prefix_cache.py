"""The `prefix` cache strategy: copy isolation, longest-prefix choice, LRU eviction under a byte
bound, the memory guard, and - on the embedded model - that reuse never changes greedy output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from dspark_flow import registry
from dspark_flow.pipeline import Pipeline
from dspark_flow.strategies.caches import prefix as prefix_mod
from dspark_flow.strategies.caches.prefix import PrefixCacheConfig, PrefixCacheStrategy

LAYERS, HEADS, DIM = 2, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # keys + values, float32


class StubModel:
    """Just enough of a model for make_prompt_cache: plain KVCache per layer."""

    layers = [None] * LAYERS


def filled_cache(tokens: list[int]) -> list[KVCache]:
    """A cache whose entries encode their token and position: easy to check after copying."""
    cache = [KVCache() for _ in range(LAYERS)]
    for layer_index, layer in enumerate(cache):
        rows = np.array(
            [[t * 1000 + pos * 10 + layer_index] * DIM for pos, t in enumerate(tokens)],
            dtype=np.float32,
        )
        kv = mx.array(np.broadcast_to(rows, (1, HEADS, len(tokens), DIM)).copy())
        layer.update_and_fetch(kv, -kv)
    return cache


def layer_values(cache: list[KVCache], layer: int = 0) -> np.ndarray:
    keys, _ = cache[layer].keys_and_values() if cache[layer].offset else (None, None)
    return np.array(keys[0, 0, :, 0]) if keys is not None else np.zeros(0)


def strategy(max_bytes: int = 1 << 30, **kw: int) -> PrefixCacheStrategy:
    return PrefixCacheStrategy(PrefixCacheConfig(max_bytes=max_bytes, **kw))


def test_registered_as_cache_prefix():
    cls = registry.load_kind("cache", "prefix")
    assert cls is PrefixCacheStrategy
    assert cls.Config.model_validate({"kind": "prefix", "max_bytes": 10}).max_bytes == 10


def test_miss_then_hit_with_the_common_prefix():
    s = strategy()
    cache, n = s.new(StubModel(), [1, 2, 3])
    assert n == 0 and s.last_reused == 0
    s.finish(filled_cache([1, 2, 3, 4, 5]), [1, 2, 3, 4, 5])
    cache, n = s.new(StubModel(), [1, 2, 3, 9, 9, 9])
    assert n == 3 and s.last_reused == 3
    assert all(layer.offset == 3 for layer in cache)
    expected = filled_cache([1, 2, 3])
    for i in range(LAYERS):
        assert np.array_equal(np.array(cache[i].keys), np.array(expected[i].keys[..., :3, :]))
        assert np.array_equal(np.array(cache[i].values), np.array(expected[i].values[..., :3, :]))
    stats = s.stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["reused_tokens"] == 3


def test_a_fully_cached_prompt_leaves_one_token_to_run():
    s = strategy()
    s.finish(filled_cache([1, 2, 3, 4]), [1, 2, 3, 4])
    _, n = s.new(StubModel(), [1, 2, 3, 4])
    assert n == 3  # the forward needs one token to produce the next token's logits


def test_copies_are_isolated_from_the_store():
    s = strategy()
    live = filled_cache([1, 2, 3, 4, 5, 6])
    s.finish(live, [1, 2, 3, 4, 5, 6])
    # The finished generation's cache is written again: the stored entry must not change.
    live[0].trim(3)
    live[0].update_and_fetch(mx.full((1, HEADS, 3, DIM), -7.0), mx.full((1, HEADS, 3, DIM), -7.0))

    first, n = s.new(StubModel(), [1, 2, 3, 4, 5, 6, 7])
    assert n == 6
    # Trim the copy and write different entries in place, as a rejected draft round does.
    s.trim(first, 4)
    for layer in first:
        layer.update_and_fetch(mx.full((1, HEADS, 4, DIM), 99.0), mx.full((1, HEADS, 4, DIM), 99.0))
    mx.eval([layer.keys for layer in first])
    assert layer_values(first)[2:].tolist() == [99.0] * 4

    second, n = s.new(StubModel(), [1, 2, 3, 4, 5, 6, 7])
    assert n == 6
    assert layer_values(second).tolist() == layer_values(filled_cache([1, 2, 3, 4, 5, 6])).tolist()


def test_longest_common_prefix_wins():
    s = strategy()
    s.finish(filled_cache([1, 2, 9, 9]), [1, 2, 9, 9])
    s.finish(filled_cache([1, 2, 3, 4, 5]), [1, 2, 3, 4, 5])
    s.finish(filled_cache([7, 8]), [7, 8])
    cache, n = s.new(StubModel(), [1, 2, 3, 4, 6])
    assert n == 4
    assert layer_values(cache).tolist() == layer_values(filled_cache([1, 2, 3, 4])).tolist()
    _, n = s.new(StubModel(), [1, 2, 9, 5])
    assert n == 3
    _, n = s.new(StubModel(), [5, 5])
    assert n == 0


def test_lru_eviction_order_under_the_byte_bound():
    s = strategy(max_bytes=2 * 4 * BYTES_PER_TOKEN)  # room for two 4-token entries
    s.finish(filled_cache([1, 1, 1, 1]), [1, 1, 1, 1])  # A
    s.finish(filled_cache([2, 2, 2, 2]), [2, 2, 2, 2])  # B
    assert s.stats()["entries"] == 2 and s.bytes == 2 * 4 * BYTES_PER_TOKEN
    s.new(StubModel(), [1, 1, 1, 5])  # use A: B is now the least recently used
    s.finish(filled_cache([3, 3, 3, 3]), [3, 3, 3, 3])  # C evicts B
    assert s.stats()["evictions"] == 1
    assert s.new(StubModel(), [2, 2, 2, 2, 2])[1] == 0
    assert s.new(StubModel(), [1, 1, 1, 1, 2])[1] == 4
    assert s.new(StubModel(), [3, 3, 3, 3, 2])[1] == 4
    assert s.bytes <= s.config.max_bytes


def test_byte_bound_holds_and_oversize_entries_are_not_stored():
    s = strategy(max_bytes=10 * BYTES_PER_TOKEN)
    for t in range(1, 8):
        s.finish(filled_cache([t] * 4), [t] * 4)
        assert s.bytes <= s.config.max_bytes
        assert s.bytes == sum(e.nbytes for e in s._entries.values())
    assert s.stats()["entries"] == 2
    s.finish(filled_cache(list(range(11))), list(range(11)))  # more than the whole budget
    assert s.stats()["entries"] == 2 and s.new(StubModel(), list(range(12)))[1] == 0


def test_store_trims_to_the_tokens_named_and_replaces_shorter_entries():
    s = strategy()
    # The loop cut a stop token after the cache took it: only the named tokens are stored.
    s.finish(filled_cache([1, 2, 3, 4, 5]), [1, 2, 3])
    assert s.stats()["tokens"] == 3
    s.finish(filled_cache([1, 2, 3, 4, 5, 6]), [1, 2, 3, 4, 5, 6])  # the next chat turn
    assert s.stats()["entries"] == 1 and s.stats()["tokens"] == 6
    s.finish(filled_cache([1, 2, 3, 4]), [1, 2, 3, 4])  # already covered
    assert s.stats()["entries"] == 1


def test_memory_guard_evicts_oldest_while_above_the_ceiling(monkeypatch):
    s = strategy()
    for t in range(1, 5):
        s.finish(filled_cache([t] * 4), [t] * 4)
    per_entry = 4 * BYTES_PER_TOKEN
    monkeypatch.setattr(prefix_mod, "active_memory_probe", lambda: lambda: 1000 + s.bytes)
    assert s.relieve_memory(ceiling=1000 + 10 * per_entry) == 0
    assert s.relieve_memory(ceiling=1000 + 2 * per_entry) == 2
    assert s.new(StubModel(), [1, 1, 1, 1, 1])[1] == 0  # the oldest went first
    assert s.new(StubModel(), [4, 4, 4, 4, 4])[1] == 4
    monkeypatch.setattr(prefix_mod, "active_memory_probe", lambda: None)
    assert s.relieve_memory(ceiling=0) == 0  # no counter on this build: nothing to go by


def test_cache_problems_never_fail_a_generation():
    s = strategy()
    s.finish(filled_cache([1, 2, 3, 4]), [1, 2, 3, 4])

    class ThreeLayers:
        layers = [None] * 3

    cache, n = s.new(ThreeLayers(), [1, 2, 3, 4, 5])  # a layer count the entry does not fit
    assert n == 0 and len(cache) == 3 and all(layer.offset == 0 for layer in cache)
    s.finish([object()], [1, 2])  # not a KVCache: ignored
    assert s.stats()["entries"] == 1


def test_zero_bytes_disables_storing():
    s = strategy(max_bytes=0)
    s.finish(filled_cache([1, 2, 3]), [1, 2, 3])
    assert s.stats()["entries"] == 0


# -- on the embedded model ---------------------------------------------------------------------


def _pipeline(embedded, cache: dict) -> Pipeline:
    return Pipeline.from_dict(
        {
            "drafter": {"kind": "lookup", "max_draft": 8},
            "draft_cap": {"kind": "full_block"},
            "cache": cache,
            "stop": [{"kind": "eos"}, {"kind": "max_tokens", "limit": 10}],
        },
        target=embedded,
    ).warm_up()


@pytest.mark.slow
def test_prefix_reuse_is_lossless_token_for_token(embedded):
    plain = _pipeline(embedded, {"kind": "kv"})
    reuse = _pipeline(embedded, {"kind": "prefix"})
    turn1 = [
        {"role": "user", "content": "Repeat after me: the quick brown fox jumps over the lazy dog."}
    ]
    first = reuse.generate(turn1)
    assert first.token_ids == plain.generate(turn1).token_ids
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now say it backwards, word by word."},
    ]
    second = reuse.generate(turn2)
    assert reuse.cache.last_reused > len(reuse.encode_prompt(turn1))  # the reply came along too
    assert second.token_ids == plain.generate(turn2).token_ids
    again = reuse.generate(turn2)  # the whole prompt is cached now
    assert reuse.cache.last_reused == len(reuse.encode_prompt(turn2)) - 1
    assert again.token_ids == second.token_ids
