"""The decode loop on the real embedded model: lossless speculation at T=0, stops, streaming,
finish reasons, seeds, and build-time refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_flow.api import draft_model_generate, greedy_generate, lookup_generate
from dspark_flow.errors import ConfigError, DsparkFlowError, RecipeError
from dspark_flow.pipeline import Pipeline

PROMPTS = [
    json.loads(line)
    for line in (Path(__file__).parent.parent / "dspark_flow/data/prompts.jsonl")
    .read_text()
    .splitlines()
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def greedy_refs(embedded):
    """Plain greedy output for the first 12 prompts (computed once)."""
    model, tok = embedded
    return [
        greedy_generate(model, tok, p["turns"][0], max_new_tokens=MAX_NEW) for p in PROMPTS[:12]
    ]


def test_greedy_answers_paris(greedy_refs):
    assert "Paris" in greedy_refs[0].text
    r = greedy_refs[0]
    # Plain decoding: one token per round; an end-of-sequence token costs a round but is cut.
    assert r.num_rounds in (r.num_tokens - 1, r.num_tokens) and r.mean_accept_len == 1.0
    # Two prefill forwards (the prompt but its last token, then that token) + one per round,
    # + where plain rounds overlap, the one launched ahead on the stop token before it was read.
    from dspark_flow.engine.decode import overlaps_plain_rounds

    assert r.finish_reason == "stop"
    assert r.target_forwards == r.num_rounds + 2 + overlaps_plain_rounds()


def test_lookup_is_lossless_on_12_prompts(embedded, greedy_refs):
    model, tok = embedded
    drafted = 0
    for prompt, ref in zip(PROMPTS[:12], greedy_refs):
        res = lookup_generate(model, tok, prompt["turns"][0], max_new_tokens=MAX_NEW)
        assert res.token_ids == ref.token_ids, prompt["turns"][0][:40]
        assert res.text == ref.text
        # Rounds make the tokens plain decoding's rounds make, an end token included, and
        # nothing a round committed past a stop.
        assert sum(res.accept_lengths) == sum(ref.accept_lengths)
        drafted += res.num_tokens - 1 - res.num_rounds
    assert drafted > 30  # the copy-heavy prompts really did accept drafts (42 on 2026-12-04)


def test_the_one_call_api_takes_a_verifier(embedded, greedy_refs):
    model, tok = embedded
    prompt, ref = PROMPTS[0]["turns"][0], greedy_refs[0]
    section = {"kind": "reference", "compile_layers": True}
    res = lookup_generate(model, tok, prompt, max_new_tokens=MAX_NEW, verifier=section)
    assert res.token_ids == ref.token_ids
    with pytest.raises(DsparkFlowError, match="verifier"):
        greedy_generate(model, tok, prompt, max_new_tokens=4, verifier={"kind": "nope"})


def test_draft_model_lossless_with_a_disagreeing_draft(embedded, greedy_refs):
    """A random tiny draft model is rejected most of the time: every round trims the cache."""
    from tests.tiny import tiny_model

    model, tok = embedded
    draft = tiny_model(seed=3)
    for prompt, ref in list(zip(PROMPTS, greedy_refs))[::4]:
        res = draft_model_generate(model, tok, draft, prompt["turns"][0], max_new_tokens=32)
        assert res.token_ids == ref.token_ids[:32]


def test_draft_model_lossless_with_an_agreeing_draft(embedded, greedy_refs):
    """The target's own 4-bit weights as draft: long acceptances, bonus tokens, budget clipping."""
    from dspark_flow.api import load_target

    model, tok = embedded
    draft, _ = load_target(weights="native")
    prompt, ref = PROMPTS[1], greedy_refs[1]
    res = draft_model_generate(model, tok, draft, prompt["turns"][0], max_new_tokens=30)
    assert res.token_ids == ref.token_ids[:30]
    assert res.mean_accept_len > 2.0


def test_stop_string_spanning_token_boundary(embedded, greedy_refs):
    model, tok = embedded
    ref = greedy_refs[1]
    # Find two neighbouring tokens and a stop string made of the end of one and start of the next.
    for i in range(5, len(ref.token_ids) - 1):
        a = tok.decode(ref.token_ids[i : i + 1])
        b = tok.decode(ref.token_ids[i + 1 : i + 2])
        if len(a.strip()) >= 2 and len(b.strip()) >= 2:
            break
    stop = a[-2:] + b[:2]
    at = ref.text.find(stop)
    assert at > 0
    for generate in (greedy_generate, lookup_generate):
        pieces: list[str] = []
        res = generate(
            model,
            tok,
            PROMPTS[1]["turns"][0],
            max_new_tokens=MAX_NEW,
            stop=[stop],
            on_text=pieces.append,
        )
        assert res.text == ref.text[:at]
        assert res.finish_reason == "stop"
        assert "".join(pieces) == res.text


def test_a_stop_string_ends_speculation_where_it_ends_greedy_decoding(embedded):
    """A round commits several tokens: those after the one completing a stop string used to stay
    in `token_ids` (the text was cut right), so speculative and greedy ids differed."""
    from dspark_flow.api import load_drafter, speculative_generate

    model, tok = embedded
    drafter = load_drafter("builtin:smollm2-135m-dspark", model)
    prompt = "Write a Python function that returns the sum of a list."
    text = greedy_generate(model, tok, prompt, max_new_tokens=MAX_NEW).text
    tail = text[12:24]
    # Single strings, and a pair where the longer one starts first but is completed later.
    for stop in (["return"], ["def "], ["\n\n"], [tail, tail[6:9]]):
        plain = greedy_generate(model, tok, prompt, max_new_tokens=MAX_NEW, stop=stop)
        pieces: list[str] = []
        spec = speculative_generate(
            model, tok, drafter, prompt, max_new_tokens=MAX_NEW, max_draft_tokens=None,
            stop=stop, on_text=pieces.append,
        )  # fmt: skip
        assert plain.finish_reason == spec.finish_reason == "stop", stop
        assert spec.token_ids == plain.token_ids and spec.num_tokens == plain.num_tokens, stop
        assert spec.text == plain.text == "".join(pieces), stop
        # τ counts the tokens up to the stop, not those the last round committed past it.
        assert sum(spec.accept_lengths) == sum(plain.accept_lengths) == plain.num_tokens - 1


def test_a_stop_string_that_later_tokens_rewrite_away_still_stops_a_round():
    """Hugging Face's clean-up rewrites " ' s" to "'s": plain decoding saw the stop "x '" after
    two tokens; a round committing four at once decoded only "x's y" and ran on past it."""
    from dspark_flow.engine.textstream import TextStream
    from dspark_flow.strategies.stops.strings import StringsConfig, StringsStop

    pieces = {0: "x", 1: " '", 2: " s", 3: " y"}

    class CleaningTokenizer:
        clean_up_tokenization_spaces = True

        def decode(self, ids: list[int]) -> str:
            return "".join(pieces[i] for i in ids).replace(" ' ", "'").replace(" 's", "'s")

    stops = [StringsStop(StringsConfig(strings=["x '"]))]
    ids = [0, 1, 2, 3]
    plain = TextStream(CleaningTokenizer(), stops, None)
    kept = next(k for m in range(1, 5) if (k := plain.update(ids[:m])) is not None)
    assert kept == 2
    for first_round in (1, 0):  # a round of one token then three, and all four in one
        spec = TextStream(CleaningTokenizer(), stops, None)
        assert first_round == 0 or spec.update(ids[:first_round]) is None
        assert spec.update(ids) == kept


@pytest.mark.parametrize("shape", ["keeps its token", "drops the end of a pair"])
def test_a_plugin_stop_rule_counts_rounds_as_plain_decoding_does(embedded, shape):
    """A stop rule's index says where output ends, not which token stopped it: the last round
    counts the tokens plain decoding made before the rule fired, one token at a time."""
    from dspark_flow.strategy import StopRule, StrategyConfig

    class RuleConfig(StrategyConfig):
        kind: str = "pair"

    model, tok = embedded
    prompt = "Repeat after me: one two three, one two three, one two three, one two three."
    ref = greedy_generate(model, tok, prompt, max_new_tokens=MAX_NEW)
    ids = ref.token_ids  # the answer repeats itself, so lookup copies its later rounds whole
    j = next(j for j in range(len(ids) // 2, len(ids)) if ids[j] not in ids[:j])  # a new token
    a, b = ids[j - 1], ids[j]

    class Rule(StopRule):
        Config = RuleConfig

        def check_tokens(self, generated: list[int], start: int) -> int | None:
            for i in range(max(start, 1), len(generated)):
                if shape == "keeps its token" and generated[i] == b:
                    return i + 1  # output keeps the token that stopped it
                if shape != "keeps its token" and generated[i - 1 : i + 1] == [a, b]:
                    return i  # output ends before the pair's second token
            return None

    results = []
    for drafter in ("none", "lookup"):
        pipe = Pipeline.from_dict(
            {"drafter": {"kind": drafter}, "stop": [{"kind": "max_tokens", "limit": MAX_NEW}]},
            target=embedded,
        ).warm_up()
        pipe.stops.append(Rule())
        results.append(pipe.generate(prompt))
    plain, spec = results
    assert spec.token_ids == plain.token_ids and plain.finish_reason == "stop"
    assert max(spec.accept_lengths) > 1  # the copies ran past the stop in one round
    assert sum(spec.accept_lengths) == sum(plain.accept_lengths)
    assert min(spec.accept_lengths) >= 1


def test_streaming_concatenation_and_utf8(embedded):
    model, tok = embedded
    pieces: list[str] = []
    prompt = "Write the word café five times, then three emoji: 🙂🚀🌍"
    res = lookup_generate(model, tok, prompt, max_new_tokens=40, on_text=pieces.append)
    assert "".join(pieces) == res.text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in res.text
    assert len(pieces) > 1


def test_finish_reasons(embedded):
    model, tok = embedded
    short = greedy_generate(model, tok, PROMPTS[0]["turns"][0], max_new_tokens=64)
    assert short.finish_reason == "stop"
    assert not set(short.token_ids) & set(tok.eos_token_ids)
    long = greedy_generate(model, tok, "Tell me a long story.", max_new_tokens=5)
    assert long.finish_reason == "length" and long.num_tokens == 5


def test_seeded_sampling_is_deterministic(embedded):
    model, tok = embedded
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95)
    a = lookup_generate(model, tok, PROMPTS[15]["turns"][0], seed=11, **kw)
    b = lookup_generate(model, tok, PROMPTS[15]["turns"][0], seed=11, **kw)
    c = greedy_generate(model, tok, PROMPTS[3]["turns"][0], seed=11, **kw)
    d = greedy_generate(model, tok, PROMPTS[3]["turns"][0], seed=12, **kw)
    assert a.token_ids == b.token_ids
    assert c.token_ids != d.token_ids


@pytest.mark.parametrize(
    "settings", [{"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300}], ids=str
)
def test_settings_that_round_to_zero_sample_the_top_token(embedded, greedy_refs, settings):
    """A temperature or top_p that is 0 in float32 leaves only the top token (it made NaNs,
    and tokens of id 0, under status 200 from the server)."""
    model, tok = embedded
    for prompt, ref in list(zip(PROMPTS, greedy_refs))[:3]:
        res = lookup_generate(
            model, tok, prompt["turns"][0], max_new_tokens=MAX_NEW, seed=3, **settings
        )
        assert res.token_ids == ref.token_ids, prompt["turns"][0][:40]


def test_a_long_prompt_is_read_in_chunks_a_consumer_may_stop_between(embedded):
    """The server stops a generation at any event; a long prompt's prefill was none (a client
    that gave up on 8,000 tokens held the worker for minutes). Stopping there loses nothing:
    the prefix cache, which the interrupted read never filled, still gives greedy's tokens."""
    from dspark_flow.engine.decode import PREFILL_CHUNK, PrefillEvent

    model, tok = embedded
    repo = Path(__file__).parent.parent
    pipe = Pipeline.from_yaml(repo / "recipes/lookup.yaml", ["stop.1.limit=8"], target=embedded)
    ids = tok.encode(" ".join(p["turns"][0] for p in PROMPTS * 3))[: 2 * PREFILL_CHUNK + 40]
    assert len(ids) == 2 * PREFILL_CHUNK + 40
    events = pipe.warm_up().events(ids)
    first = next(events)
    assert first == PrefillEvent(done=PREFILL_CHUNK, total=len(ids))
    events.close()  # the consumer stops here, as the server does for a client gone
    seen = list(pipe.events(ids))
    progress = [e for e in seen if isinstance(e, PrefillEvent)]
    # Every token but the last goes in before the one forward whose logits are read.
    assert [e.done for e in progress] == [PREFILL_CHUNK, 2 * PREFILL_CHUNK, len(ids) - 1]
    assert seen[-1].result.token_ids == greedy_generate(model, tok, ids, max_new_tokens=8).token_ids


def test_pipeline_from_yaml_and_events(embedded):
    repo = Path(__file__).parent.parent
    pipe = Pipeline.from_yaml(repo / "recipes/lookup.yaml", ["stop.1.limit=12"], target=embedded)
    events = list(pipe.warm_up().events("Repeat: one two three four five six"))
    from dspark_flow.engine.decode import DoneEvent, TextEvent

    assert isinstance(events[-1], DoneEvent)
    text = "".join(e.text for e in events if isinstance(e, TextEvent))
    assert text == events[-1].result.text and events[-1].result.num_tokens <= 12


@pytest.mark.parametrize(
    "override",
    ["draft_cap.k=0", "sampler.temperature=-0.5", "sampler.top_p=0", "sampler.top_p=1.5"],
)
def test_bad_sampling_and_cap_values_fail_at_build(override):
    section = "draft_cap.kind=fixed" if override.startswith("draft_cap") else "sampler.kind=sample"
    repo = Path(__file__).parent.parent
    with pytest.raises(RecipeError):
        Pipeline.from_yaml(repo / "recipes/lookup.yaml", [section, override])


def test_draft_model_with_other_tokenizer_is_refused(embedded, tmp_path):
    from dspark_flow.models.embedded import ensure_builtin
    from tests.tiny import save_tiny, tiny_model

    other = save_tiny(tiny_model(seed=1), tmp_path / "draft", ensure_builtin())
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(data))
    pipe = Pipeline.from_dict(
        {"drafter": {"kind": "draft_model", "model": str(other)}}, target=embedded
    )
    with pytest.raises(ConfigError, match="different tokenizer"):
        pipe.warm_up()


def test_cli_prompt_from_stdin_asks_what_the_argument_asks(monkeypatch, capsys):
    """`echo PROMPT | dspark-flow run R --prompt -` ends its prompt with echo's newline."""
    import io

    from dspark_flow.cli.main import main

    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml")
    argv = ["run", recipe, "--max-tokens", "8", "--json"]
    assert main([*argv, "--prompt", "Say hello."]) == 0
    direct = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hello.\n"))
    assert main([*argv, "--prompt", "-"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["token_ids"] == direct["token_ids"]


# -- plain rounds launched before the previous token is read ---------------------------------


def _decode_with_overlap(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    from dspark_flow.engine import decode

    monkeypatch.setattr(decode, "OVERLAP_PLAIN_ROUNDS", on)


def test_overlapped_plain_rounds_decode_what_reading_first_decodes(embedded, monkeypatch):
    """Plain rounds launched on the previous round's lazy token give the tokens of rounds that
    read it first: greedy and seeded sampling, ended by the stop token, a stop string or the
    budget; and the prefix cache a stopped generation leaves serves the next request alike."""
    model, tok = embedded
    cases = [
        (PROMPTS[0]["turns"][0], {"max_new_tokens": 64}),  # ends on the stop token
        (PROMPTS[2]["turns"][0], {"max_new_tokens": 17}),  # ends on the budget
        (PROMPTS[4]["turns"][0], {"max_new_tokens": 40, "stop": [" the"]}),
        (PROMPTS[3]["turns"][0], {"max_new_tokens": 24, "temperature": 0.9, "seed": 5}),
    ]

    def decode_all(on: bool) -> list[list[int]]:
        _decode_with_overlap(monkeypatch, on)
        out = [greedy_generate(model, tok, p, **kw).token_ids for p, kw in cases]
        pipe = Pipeline.from_dict(
            {"cache": {"kind": "prefix"}, "stop": [{"kind": "eos"}]}, target=embedded
        )
        first = pipe.generate(PROMPTS[0]["turns"][0], max_new_tokens=64)
        assert first.finish_reason == "stop"
        follow = first.text + " And what about Spain?"
        out.append(pipe.generate(follow, max_new_tokens=24, chat=False).token_ids)
        return out

    overlapped, read_first = decode_all(True), decode_all(False)
    assert overlapped == read_first
    assert len(overlapped[1]) == 17


def test_auto_overlaps_its_off_rounds_and_drafts_again_after(embedded, greedy_refs, monkeypatch):
    """With the shipped DSpark drafter and costs under which it rarely pays, `auto` switches
    off: its plain rounds are launched ahead (the verify forward gets a lazy token), probes
    still draft in between (the drafter's features line up with the history), and the output
    is greedy's."""
    import mlx.core as mx

    from dspark_flow.calibration.curves import Curves
    from dspark_flow.strategies.draft_caps.auto import AutoCap, AutoCapConfig

    _decode_with_overlap(monkeypatch, True)
    curves = Curves(depths=[64], verify=[[1e-3] * 8], drafter=[0.0] + [2.5e-3] * 7)
    cap = AutoCap(AutoCapConfig(learn_round_cost=False, probe_every=4), curves=curves)
    recipe = {
        "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"},
        "stop": [{"kind": "eos"}, {"kind": "max_tokens", "limit": MAX_NEW}],
    }
    pipe = Pipeline.from_dict(recipe, target=embedded, draft_cap=cap).warm_up()
    forward = pipe.verifier.forward
    lazy_inputs: list[bool] = []

    def recorded(model, tokens, cache):
        lazy_inputs.append(isinstance(tokens, mx.array) and tokens.size == 1)
        return forward(model, tokens, cache)

    pipe.verifier.forward = recorded
    for prompt, ref in list(zip(PROMPTS, greedy_refs))[:3]:
        before = dict(cap.chosen)
        res = pipe.generate(prompt["turns"][0], max_new_tokens=MAX_NEW)
        assert res.token_ids == ref.token_ids
        drafted = sum(n for k, n in cap.chosen.items() if k > 0) - sum(
            n for k, n in before.items() if k > 0
        )
        assert drafted > 0  # probes (or drafting) between the overlapped off rounds
    assert sum(lazy_inputs) > 10


def test_a_recipe_without_a_token_budget_stops_where_the_context_ends(embedded):
    """No stop rule bounds the output: the loop stops at the model's trained context rather
    than run on (it used to, until memory ran out)."""
    from tests.tiny import tiny_model

    _, tok = embedded
    model = tiny_model(seed=1)
    model.args.max_position_embeddings = 48
    pipe = Pipeline.from_dict({"stop": []}, target=(model, tok))
    prompt = "Count to ten."
    res = pipe.generate(prompt)
    assert res.finish_reason == "length"
    assert res.num_tokens == 48 - len(pipe.encode_prompt(prompt))
    # A max_tokens past the context stops there too (it ran on past the trained positions).
    assert pipe.generate(prompt, max_new_tokens=500).token_ids == res.token_ids


@pytest.mark.parametrize(
    ("proposal", "words"),
    [(10**9, "outside the vocabulary"), (None, "not a Draft"), ([1] * 3, "proposed 3 tokens")],
)
def test_a_drafter_proposing_what_no_forward_can_take_is_named(embedded, proposal, words):
    """A plugin drafter's ids past the embedding would crash the verify forward (a segfault on
    the CPU); its proposal is checked and the drafter named in one line."""
    from typing import Literal

    from dspark_flow.strategy import Draft, Drafter, StrategyConfig

    class WildConfig(StrategyConfig):
        kind: Literal["wild"] = "wild"

    class WildDrafter(Drafter):
        Config = WildConfig

        @property
        def max_draft(self) -> int:
            return 2

        def propose(self, history: list[int], k: int) -> Draft:
            if isinstance(proposal, list):  # more than asked for: past the budget, exact rows
                return Draft(tokens=proposal)
            return None if proposal is None else Draft(tokens=[proposal] * k)  # type: ignore[return-value]

    recipe = {"draft_cap": {"kind": "fixed", "k": 2}, "stop": [{"kind": "max_tokens", "limit": 8}]}
    pipe = Pipeline.from_dict(recipe, target=embedded, drafter=WildDrafter())
    with pytest.raises(ConfigError, match=f"drafter WildDrafter.*{words}") as info:
        pipe.generate("Hi there")
    assert "\n" not in str(info.value)
