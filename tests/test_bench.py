"""`dspark-flow bench`: prompt files, the report schema, the free output-equality check.

The model-backed tests run 2 short prompts, 8 tokens, 1 trial on the embedded target.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_flow.bench.prompts import BenchPrompt, load_prompts
from dspark_flow.cli.main import main
from dspark_flow.errors import DsparkFlowError

REPO = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str) -> None:
    """Run benchmarks/<script> with `args` in a fresh process; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


RECIPES = REPO / "recipes"
META_KEYS = {
    "machine",
    "cpu",
    "backend",
    "mlx_version",
    "mlx_lm_version",
    "dspark_flow_version",
    "weight_format",
    "date",
    "command",
}
RUN_KEYS = {
    "target": str,
    "mode": str,
    "kind": str,
    "baseline": bool,
    "category": str,
    "prompt_id": str,
    "trial": int,
    "prompt_tokens": int,
    "num_tokens": int,
    "decode_tok_s": float,
    "e2e_tok_s": float,
    "ttft_s": float,
    "mean_accept_len": float,
    "finish_reason": str,
    "accept_lengths": list,
}
STAT_FIGURES = ("decode_tok_s", "e2e_tok_s", "ttft_s", "mean_accept_len", "num_tokens")


def has_matplotlib() -> bool:
    from dspark_flow.bench.plots import available

    return available()


# -- prompt files (no model) -------------------------------------------------------------------


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "humaneval.jsonl"
    jsonl.write_text(
        '{"turns": ["first", "second turn is ignored"]}\n\n'
        '{"turns": ["tagged"], "category": "code"}\n'
        '{"turns": ["third"]}\n'
    )
    text = tmp_path / "mine.txt"
    text.write_text("one prompt\n\n  another prompt  \n")
    prompts = load_prompts([jsonl, text], limit=1)
    assert [(p.category, p.text) for p in prompts] == [
        ("humaneval", "first"),
        ("code", "tagged"),
        ("mine", "one prompt"),
    ]
    assert len({p.id for p in prompts}) == len(prompts)
    shipped = load_prompts()
    assert len(shipped) == 24
    assert {p.category for p in shipped} == {"chat", "code", "math", "edit"}


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"turns": ["ok"]}\n{"turns": [broken\n', "line 2: not valid JSON"),
        ('{"prompt_list": ["x"]}\n', "line 1: expected 'turns'"),
        ("", "holds no prompts"),
    ],
)
def test_bad_prompt_file_is_one_error(tmp_path, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(DsparkFlowError, match=needle):
        load_prompts([bad])


def test_ready_prompts_take_the_limit_per_category_and_no_files_beside_them(tmp_path):
    from dspark_flow.bench.api import bench
    from dspark_flow.bench.prompts import first_per_category

    ready = [BenchPrompt(f"{c}-{i}", c, f"{c} {i}") for i in range(3) for c in ("chat", "code")]
    kept = first_per_category(ready, 2)
    assert [p.id for p in kept] == ["chat-0", "code-0", "chat-1", "code-1"]
    assert first_per_category(ready, None) == ready
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"category": "chat", "turns": ["hi"]}\n')
    # A mix was handed to the file reader, which failed on the BenchPrompt with a TypeError.
    with pytest.raises(DsparkFlowError, match="not a mix"):
        bench([RECIPES / "lookup.yaml"], [ready[0], prompts_file])


def test_cli_refuses_unparseable_prompts(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json at all\n")
    rc = main(
        ["bench", str(RECIPES / "lookup.yaml"), "--prompts", str(bad), "--out", str(tmp_path)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: prompts file") and "not valid JSON" in err[0]
    assert not (tmp_path / "bench.json").exists()


def test_cli_exits_3_on_mismatch(tmp_path, monkeypatch, capsys):
    """The CLI side of the equality check, without a model: a mismatch means exit code 3."""
    from dspark_flow.bench import api

    data = {
        "meta": {"date": "now"},
        "runs": [],
        "summary": [],
        "mismatches": [
            {"mode": "broken", "prompt_id": "edit-0", "trial": 0, "first_difference": 2}
        ],
    }
    monkeypatch.setattr(api, "bench", lambda *a, **k: api.BenchOutcome(data))
    rc = main(["bench", str(RECIPES / "lookup.yaml"), "--out", str(tmp_path)])
    assert rc == 3
    assert "OUTPUT MISMATCH: broken on edit-0" in capsys.readouterr().err


def test_help_stays_light():
    """Building the parser (what `dspark-flow --help` does) must not import the bench machinery."""
    code = (
        "import sys; from dspark_flow.cli.main import build_parser; build_parser(); "
        "heavy = [m for m in ('dspark_flow.bench.runner', 'matplotlib', 'mlx_lm') if m in sys.modules]; "
        "sys.exit(str(heavy) if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_compare_and_rounds():
    from dspark_flow.bench.runner import compare, mlx_lm_rounds

    assert compare([1, 2, 3], [1, 2, 3], prefix_only=False) is None
    assert compare([1, 2, 3], [1, 9, 3], prefix_only=False) == 1
    assert compare([1, 2, 3], [1, 2], prefix_only=False) == 2
    assert compare([1, 2, 3], [1, 2], prefix_only=True) is None
    assert compare([1, 2], [1, 2, 3], prefix_only=True) == 2
    # mlx-lm speculative: accepted drafts (True) then the target's token (False) per round.
    assert mlx_lm_rounds([True, True, False, False, True, False, True]) == [3, 1, 2, 1]


def test_speedup_figures():
    from dspark_flow.bench.summary import summarize

    def run(mode: str, prompt: str, tok_s: float) -> dict:
        figures = dict.fromkeys(("e2e_tok_s", "ttft_s", "mean_accept_len", "peak_memory_mb"), 1.0)
        return {
            "target": "t",
            "mode": mode,
            "kind": "ours",
            "baseline": mode == "greedy",
            "category": "c",
            "prompt_id": prompt,
            "trial": 0,
            "decode_tok_s": tok_s,
            "num_tokens": 8,
            **figures,
        }

    runs = [
        run("greedy", "a", 10),
        run("greedy", "b", 20),
        run("fast", "a", 30),
        run("fast", "b", 20),
    ]
    row = next(r for r in summarize(runs) if r["mode"] == "fast")
    decode = row["speedup"]["greedy"]["decode"]
    assert decode["ratio_of_medians"] == pytest.approx(25 / 15)
    assert decode["median_of_ratios"] == pytest.approx((3.0 + 1.0) / 2)
    # 7 decode tokens a run (the first is the prefill's): greedy 0.7 + 0.35 s, fast 7/30 + 0.35 s
    assert decode["ratio_of_totals"] == pytest.approx(1.05 / (7 / 30 + 0.35))
    assert row["decode_tok_s"] == {"median": 25.0, "min": 20.0, "max": 30.0}

    # Totals count only the runs both modes made: a run greedy lacks changes nothing.
    extra = summarize([*runs, run("fast", "c", 1)])
    fast = next(r for r in extra if r["mode"] == "fast")["speedup"]["greedy"]["decode"]
    assert fast["ratio_of_totals"] == pytest.approx(decode["ratio_of_totals"])

    # A mode with no decode rate at all (every run a single token) has no ratio, not 0.
    silent = [{**run("mute", p, 1), "decode_tok_s": None} for p in ("a", "b")]
    mute = next(r for r in summarize([*runs, *silent]) if r["mode"] == "mute")
    assert mute["speedup"]["greedy"]["decode"] == dict.fromkeys(
        ("ratio_of_medians", "median_of_ratios", "ratio_of_totals")
    )


# -- with the embedded model -------------------------------------------------------------------


@pytest.mark.slow
def test_report_schema_through_cli(tmp_path, capsys):
    prompts = tmp_path / "two.txt"
    prompts.write_text("Repeat this: the cat sat on the mat.\nSay hello.\n")
    out = tmp_path / "out"
    argv = ["bench", str(RECIPES / "lookup.yaml"), "--prompts", str(prompts), "--trials", "1"]
    argv += ["--max-tokens", "8", "--verify-repeats", "1", "--out", str(out), "--quiet"]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err

    data = json.loads((out / "bench.json").read_text())
    assert {"meta", "runs", "summary"} <= set(data)
    assert set(data["meta"]) >= META_KEYS
    assert all(isinstance(data["meta"][k], str) for k in META_KEYS)
    assert data["meta"]["command"].startswith("dspark-flow bench ")

    modes = {r["mode"] for r in data["runs"]}
    assert modes == {"greedy", "mlx-lm", "lookup"}
    assert len(data["runs"]) == 2 * len(modes)
    for r in data["runs"]:
        for key, typ in RUN_KEYS.items():
            assert isinstance(r[key], typ), (key, r[key])
        assert r["peak_memory_mb"] is None or r["peak_memory_mb"] > 0
        assert r["num_tokens"] <= 8
        if r["mode"] != "greedy":
            assert r["matches_greedy"] is True, r  # lossless, and mlx-lm agrees with our loop

    rows = {(s["mode"], s["category"]) for s in data["summary"]}
    assert ("lookup", "two") in rows and ("greedy", "two") in rows
    lookup = next(s for s in data["summary"] if s["mode"] == "lookup")
    for figure in STAT_FIGURES:
        assert set(lookup[figure]) == {"median", "min", "max"}
    assert set(lookup["speedup"]) == {"greedy", "mlx-lm"}
    assert set(lookup["speedup"]["greedy"]["decode"]) == {
        "ratio_of_medians",
        "median_of_ratios",
        "ratio_of_totals",
    }
    assert data["mismatches"] == []
    assert [c["k"] for c in data["verify_cost"]] == list(range(1, 17))

    md = (out / "bench.md").read_text()
    assert "| category | mode |" in md and "mlx_version" in md and "MISMATCH" not in md
    if has_matplotlib():
        for png in ("speed.png", "acceptance.png", "verify_cost.png"):
            if png != "acceptance.png" or any(
                max(r["accept_lengths"] or [1]) > 1 for r in data["runs"]
            ):
                assert (out / png).stat().st_size > 1000, png
    # The table also goes to stdout.
    assert "| lookup |" in captured.out or "lookup" in captured.out

    # --from-json re-renders a saved run; one it cannot render leaves the report as it was.
    saved = (out / "bench.json").read_bytes()
    again = tmp_path / "again"
    assert main(["bench", "--from-json", str(out / "bench.json"), "--out", str(again)]) == 0
    assert json.loads((again / "bench.json").read_text()) == data
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"meta": {}, "runs": [{"x": 1}], "summary": []}))
    capsys.readouterr()
    assert main(["bench", "--from-json", str(broken), "--out", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "is not a bench.json this version can render" in err and len(err.splitlines()) == 1
    # a later format is named as such, not rendered until a field is missing
    broken.write_text(json.dumps({**data, "meta": {**data["meta"], "schema": 999}}))
    assert main(["bench", "--from-json", str(broken), "--out", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {broken} is bench.json format 999; this version renders format 1\n"
    assert (out / "bench.json").read_bytes() == saved
    if has_matplotlib():  # renders as Markdown, fails in a plot: still nothing replaced
        plots_fail = {
            **data,
            "runs": [{k: v for k, v in r.items() if k != "kind"} for r in data["runs"]],
        }
        broken.write_text(json.dumps(plots_fail))
        assert main(["bench", "--from-json", str(broken), "--out", str(out)]) == 2
        capsys.readouterr()
        assert (out / "bench.json").read_bytes() == saved
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no scratch
    # A report rendered again without plots takes the earlier figures away with it.
    assert (
        main(["bench", "--from-json", str(out / "bench.json"), "--out", str(out), "--no-plots"])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    assert main(["bench", str(RECIPES / "lookup.yaml"), "--from-json", str(broken)]) == 2
    assert "leave out the recipes" in capsys.readouterr().err


def _count_measures(monkeypatch, ctrl_c_at: int | None = None) -> list[int]:  # noqa: ANN001
    """The bench runner's `measure` calls, by max_tokens as they come; with `ctrl_c_at`, the
    call of that number raises KeyboardInterrupt instead, as a user's Ctrl-C would."""
    from dspark_flow.bench import runner

    calls: list[int] = []
    real = runner.measure

    def counted(mode, group, ids, max_tokens):  # noqa: ANN001
        calls.append(max_tokens)
        if len(calls) == ctrl_c_at:
            raise KeyboardInterrupt
        return real(mode, group, ids, max_tokens)

    monkeypatch.setattr(runner, "measure", counted)
    return calls


def test_warmup_trials_run_every_prompt_and_mode_unrecorded(tmp_path, monkeypatch):
    calls = _count_measures(monkeypatch)
    prompts = tmp_path / "two.txt"
    prompts.write_text("Repeat this: the cat sat on the mat.\nSay hello.\n")
    out = tmp_path / "out"
    argv = ["bench", str(RECIPES / "lookup.yaml"), "--prompts", str(prompts), "--trials", "1"]
    argv += ["--warmup-trials", "1", "--max-tokens", "20", "--no-verify-cost", "--no-plots"]
    assert main([*argv, "--no-mlx-lm", "--out", str(out), "--quiet"]) == 0
    data = json.loads((out / "bench.json").read_text())
    modes = 2  # greedy, lookup
    assert len(data["runs"]) == 2 * modes  # the warm-up pass is not recorded ...
    # ... but ran: one short (16-token) warm-up per mode, a full-length pass, then the trial.
    assert calls.count(16) == modes and calls.count(20) == 2 * modes * 2
    assert data["meta"]["config"]["warmup_trials"] == 1
    assert "--warmup-trials 1" in data["meta"]["command"]


def test_ctrl_c_mid_bench_reports_the_prompts_every_mode_finished(tmp_path, monkeypatch, capsys):
    # The 6th measurement: 2 warm-ups, prompt 1's 2 modes, prompt 2's first mode, then this.
    _count_measures(monkeypatch, ctrl_c_at=6)
    prompts = tmp_path / "two.txt"
    prompts.write_text("Repeat this: the cat sat on the mat.\nSay hello.\n")
    out = tmp_path / "out"
    argv = ["bench", str(RECIPES / "lookup.yaml"), "--prompts", str(prompts), "--trials", "2"]
    argv += ["--warmup-trials", "0", "--max-tokens", "8", "--no-plots", "--no-mlx-lm"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 130  # as any Ctrl-C
    assert "interrupted: stopped by the user after 1 of 4 prompt runs" in capsys.readouterr().err
    data = json.loads((out / "bench.json").read_text())
    assert sorted(r["mode"] for r in data["runs"]) == ["greedy", "lookup"]
    assert len({r["prompt_id"] for r in data["runs"]}) == 1  # the half-run prompt is dropped
    assert {s["mode"] for s in data["summary"]} == {"greedy", "lookup"}
    assert "- interrupted: `stopped by the user" in (out / "bench.md").read_text()
    # Rendered again later, it is a partial report, not a new interruption.
    again = tmp_path / "again"
    assert main(["bench", "--from-json", str(out / "bench.json"), "--out", str(again)]) == 0


@pytest.mark.parametrize(
    ("ctrl_c_at", "said"),
    [
        (1, "interrupted: while warming up, before any trial: nothing measured"),
        # 2 warm-ups, then the first prompt's greedy run: no prompt has run in every mode
        (3, "interrupted: before any prompt ran in every mode: nothing measured"),
    ],
)
def test_ctrl_c_before_anything_was_measured_says_so(
    tmp_path, monkeypatch, capsys, ctrl_c_at, said
):
    _count_measures(monkeypatch, ctrl_c_at=ctrl_c_at)
    prompts = tmp_path / "one.txt"
    prompts.write_text("Say hello.\n")
    out = tmp_path / "out"
    argv = ["bench", str(RECIPES / "lookup.yaml"), "--prompts", str(prompts), "--trials", "1"]
    argv += ["--warmup-trials", "0", "--max-tokens", "8", "--no-plots", "--no-mlx-lm"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert not (out / "bench.json").exists()


@pytest.mark.slow
def test_equality_check_catches_a_broken_verifier(embedded, tmp_path):
    """A sampler whose verify accepts every draft, fed junk drafts: output differs from greedy and
    the bench must say so (JSON, Markdown). A draft-model pipeline beside it stays lossless,
    and mlx-lm's own speculative baseline runs with the same draft model."""
    from dspark_flow.bench.api import bench
    from dspark_flow.bench.runner import BenchConfig
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.strategies.drafters.draft_model import DraftModelConfig, DraftModelDrafter
    from dspark_flow.strategies.samplers.greedy import GreedySampler
    from dspark_flow.strategy import Draft, Drafter, StrategyConfig
    from tests.tiny import tiny_model

    class JunkConfig(StrategyConfig):
        kind: str = "junk"

    class JunkDrafter(Drafter):
        Config = JunkConfig

        def propose(self, history: list[int], k: int) -> Draft:
            return Draft(tokens=[42] * k)

    class AcceptEverything(GreedySampler):
        def verify(self, logits, draft: Draft) -> tuple[int, int]:
            n = len(draft.tokens)
            return n, int(logits[n].argmax().item())

    broken = Pipeline.from_dict(
        {"name": "broken", "drafter": {"kind": "lookup"}, "draft_cap": {"kind": "fixed", "k": 3}},
        target=embedded,
        drafter=JunkDrafter(),
        sampler=AcceptEverything(),
    )
    drafter = DraftModelDrafter(DraftModelConfig(model="<tiny>"), model=tiny_model())
    honest = Pipeline.from_dict(
        {
            "name": "tiny-draft",
            "drafter": {"kind": "draft_model", "model": "<tiny>"},
            "draft_cap": {"kind": "fixed", "k": 2},
        },
        target=embedded,
        drafter=drafter,
    )
    prompts = [
        BenchPrompt("edit-0", "edit", "Repeat: one two three four."),
        BenchPrompt("chat-0", "chat", "Hi!"),
    ]
    outcome = bench(
        [broken, honest],
        prompts,
        config=BenchConfig(trials=1, max_tokens=8, verify_cost=False),
        out_dir=tmp_path,
        plots=False,
    )
    data = outcome.data
    modes = {r["mode"] for r in data["runs"]}
    assert modes == {"greedy", "mlx-lm", "broken", "tiny-draft", "mlx-lm-spec[tiny-draft]"}
    bad = {m["mode"] for m in outcome.mismatches}
    assert bad == {"broken"}
    assert len(outcome.mismatches) == 2  # both prompts
    assert all(not r["matches_greedy"] for r in data["runs"] if r["mode"] == "broken")
    rows = [s for s in data["summary"] if s["mode"] == "broken"]
    assert {s["category"]: s["mismatches"] for s in rows} == {"edit": 1, "chat": 1, "all": 2}
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["mismatches"] and saved["mismatches"][0]["first_difference"] >= 0
    assert "OUTPUT MISMATCHES" in (tmp_path / "bench.md").read_text()


def test_greedy_gap_loops_make_the_same_tokens_as_mlx_lm(tmp_path):
    """benchmarks/greedy_gap.py times our plain greedy beside bare loops and mlx-lm's own
    `generate_step`: every loop must commit the same tokens (exit 0 and `same_tokens`), which
    also checks our loop against mlx-lm's greedy token for token."""
    out = tmp_path / "gap.json"
    run_benchmark("greedy_gap.py", "--trials", "1", "--max-tokens", "6", "--json", str(out))
    figures = json.loads(out.read_text())
    assert figures["same_tokens"] is True
    assert len(figures["loops"]) == 7 and figures["loops"]["ours"]["x_ours"] == 1.0
    assert all(loop["tok_s"] > 0 for loop in figures["loops"].values())


def test_compile_ab_runs_four_arms_that_make_the_same_tokens(tmp_path):
    """benchmarks/compile_ab.py times greedy and DSpark with `compile_layers` off and on, on
    held-out-style prompts from a file: all four must commit the same tokens (exit 0)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Name three colors."], "category": "chat"}) + "\n")
    out = tmp_path / "ab.json"
    args = ["--trials", "1", "--max-tokens", "8", "--prompts", str(prompts), "--json", str(out)]
    run_benchmark("compile_ab.py", *args)
    figures = json.loads(out.read_text())
    assert figures["same_tokens"] is True and figures["runs"] == 1
    assert set(figures["tok_s"]) == {"greedy off", "greedy on", "spec off", "spec on"}
    assert all(v > 0 for v in figures["tok_s"].values())


def test_drafter_attention_times_both_attentions_cold_and_warm(tmp_path):
    """benchmarks/drafter_attention.py: one pass per context length for each attention, first
    seen (cold) and again (warm), every pass timed."""
    out = tmp_path / "attention.json"
    run_benchmark("drafter_attention.py", "--steps", "3", "--start", "20", "--out", str(out))
    figures = json.loads(out.read_text())
    assert figures["backend"] == "cpu"
    for name in ("matmul", "fused"):
        runs = figures["passes_ms"][name]
        assert len(runs["cold"]) == len(runs["warm"]) == 3
        assert all(ms > 0 for ms in runs["cold"] + runs["warm"])


def test_kernel_cache_runs_four_fresh_processes(tmp_path):
    """benchmarks/kernel_cache.py: the same decode in four processes, three with the cache
    folder under dspark-flow's home and one with an empty folder of its own."""
    out = tmp_path / "cache.json"
    run_benchmark("kernel_cache.py", "--max-tokens", "4", "--out", str(out))
    rows = json.loads(out.read_text())
    assert [r["process"] for r in rows] == ["home, first", "home, again", "empty", "home, last"]
    home = {r["cache_dir"] for r in rows if r["process"].startswith("home")}
    assert len(home) == 1 and "mlx-kernels" in home.pop()
    assert "mlx-kernels-empty-" in rows[2]["cache_dir"]
    assert rows[2]["cache_files_before"] == 0  # its own folder, empty when it started


def test_attention_plans_runs_each_setting_in_its_own_process(tmp_path):
    """benchmarks/attention_plans.py: fused attention at new key lengths in three fresh
    processes (MLX's thrashing check on with 1 and with N calls per shape, off with 1), each
    reading the setting it was started with."""
    out = tmp_path / "plans.json"
    args = ("--lengths", "12", "--calls-per-shape", "3", "--out", str(out))
    run_benchmark("attention_plans.py", *args)
    rows = json.loads(out.read_text())
    assert [(r["check"], r["calls_per_shape"]) for r in rows] == [("1", 1), ("1", 3), ("0", 1)]
    assert all(r["lengths_done"] == 12 and r["error"] is None for r in rows)  # no cuDNN here


def test_new_prompts_times_the_first_pass_and_checks_outputs(tmp_path):
    """benchmarks/new_prompts.py: greedy and the recipe with each attention, a first and a
    second pass, each output greedy's (exit 0 and `same_tokens`), figures per category."""
    prompts = tmp_path / "p.jsonl"
    rows = [("Name three colors.", "chat"), ("What is 3 + 4?", "math")]
    prompts.write_text("".join(json.dumps({"turns": [t], "category": c}) + "\n" for t, c in rows))
    out = tmp_path / "new.json"
    cap = "draft_cap={kind: fixed, k: 3}"  # the shipped `auto` would measure its curves first
    args = ["--prompts", str(prompts), "--max-tokens", "8", "--set", cap, "--out", str(out)]
    run_benchmark("new_prompts.py", *args)
    figures = json.loads(out.read_text())
    assert figures["same_tokens"] is True and figures["prompts"] == 2
    assert figures["differed_from_greedy"] == {"fused": [], "matmul": []}
    for label in ("first pass", "second pass"):
        assert set(figures[label]) == {"greedy", "fused", "matmul"}
        assert all(row["decode_seconds"] > 0 for row in figures[label].values())
        assert set(figures[label]["matmul"]["speedup_by_category"]) == {"chat", "math"}
        assert figures[label]["greedy"]["speedup_by_category"] == {"chat": 1.0, "math": 1.0}


def test_new_prompts_varies_the_library_verifiers_attention(tmp_path):
    """--library --vary verifier.attention: `dflash_generate`'s stack (full block, reference
    verifier) with each attention, three passes, each output greedy's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Count to five."], "category": "chat"}) + "\n")
    out = tmp_path / "new.json"
    args = ["--prompts", str(prompts), "--max-tokens", "8", "--library", "--passes", "3",
            "--weights", "float32",
            "--recipe", str(REPO / "recipes" / "dflash.yaml"), "--set", "draft_cap.kind=full_block",
            "--vary", "verifier.attention", "--out", str(out)]  # fmt: skip
    run_benchmark("new_prompts.py", *args)
    figures = json.loads(out.read_text())
    assert figures["same_tokens"] is True and figures["library"] is True
    assert figures["weights"] == "float32"
    assert set(figures) >= {"first pass", "second pass", "pass 3"}
    assert set(figures["pass 3"]) == {"greedy", "fused", "matmul"}


def test_off_rounds_parts_count_the_decoding_calls_only(embedded, monkeypatch):
    """off_rounds.py --parts: each strategy call's host time, counted from the first token on
    (the prefill's forwards are not a round's), the loop's async_eval of a lazy draft, and
    nothing else changes the output."""
    from dspark_flow.engine import decode
    from dspark_flow.pipeline import Pipeline

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import off_rounds
    from off_rounds import LOOP_ASYNC_EVAL, time_calls

    # time_calls times the loop's mx.async_eval through the decode module: undone afterwards
    monkeypatch.setattr(decode, "mx", decode.mx)
    monkeypatch.setattr(decode, "_timed_mx", None, raising=False)
    monkeypatch.setattr(off_rounds, "_DECODING", [None])

    greedy = Pipeline.from_dict({}, target=embedded).warm_up()
    want = greedy.generate("Name three colors.", max_new_tokens=6)
    seconds: dict[str, float] = {}
    forward = greedy.verifier.forward

    def slow_prefill(model, tokens, cache):  # the prompt's chunk: many tokens, 0.3 s more
        if len(tokens) > 1:
            time.sleep(0.3)
        return forward(model, tokens, cache)

    greedy.verifier.forward = slow_prefill
    time_calls(greedy, seconds)
    got = greedy.generate("Name three colors.", max_new_tokens=6)
    assert got.token_ids == want.token_ids
    assert set(seconds) >= {"verifier.forward", "sampler.verify"}
    assert LOOP_ASYNC_EVAL not in seconds  # plain decoding drafts nothing lazily
    assert all(v > 0 for v in seconds.values())
    assert seconds["verifier.forward"] < 0.3  # the slow chunk was the prefill's, not counted

    recipe = {
        "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"},
        "draft_cap": {"kind": "fixed", "k": 3},
    }
    spec = Pipeline.from_dict(recipe, target=embedded).warm_up()
    drafted: dict[str, float] = {}
    time_calls(spec, drafted)
    before = dict(seconds)
    got = spec.generate("Name three colors.", max_new_tokens=6)
    assert got.token_ids == want.token_ids
    assert drafted[LOOP_ASYNC_EVAL] > 0 and drafted["drafter.propose"] > 0
    assert seconds == before  # each pipeline's calls go to its own figures


def test_off_rounds_sums_auto_s_rounds_by_kind(embedded, monkeypatch):
    """off_rounds.py --rounds: every round after the prefill is logged once, with its calls'
    host time, and the summary by kind adds up to the tokens the rounds committed."""
    from dspark_flow.engine import decode
    from dspark_flow.pipeline import Pipeline

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import off_rounds
    from off_rounds import record_round_kinds, summarise_round_kinds, time_calls

    monkeypatch.setattr(decode, "mx", decode.mx)
    monkeypatch.setattr(decode, "_timed_mx", None, raising=False)
    monkeypatch.setattr(off_rounds, "_DECODING", [None])
    recipe = {
        "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"},
        "draft_cap": {"kind": "auto", "depths": [16, 64], "repeats": 1, "warmup": 0},
    }
    pipe = Pipeline.from_dict(recipe, target=embedded).warm_up()
    parts: dict[str, float] = {}
    log: list[dict] = []
    time_calls(pipe, parts)
    record_round_kinds(pipe, log, parts)
    r = pipe.generate("Write a Python function that adds two numbers.", max_new_tokens=12)
    assert len(log) == r.num_rounds
    assert sum(e["accepted"] + 1 for e in log) == r.num_tokens - 1
    assert all(e["parts"]["draft_cap.choose"] > 0 for e in log)
    assert sum(sum(e["parts"].values()) for e in log) == pytest.approx(sum(parts.values()))
    kinds = summarise_round_kinds(log, greedy_ms=1.0)
    assert sum(k["tokens"] for k in kinds.values()) == r.num_tokens - 1
    assert sum(k["rounds"] for k in kinds.values()) == r.num_rounds
    drafted = [e for e in log if e["proposed"] > 0 and e["source"] != "copy"]
    assert drafted and all("rows_in" in e for e in drafted)  # each pass took rows in first
    assert drafted[0]["first"] and not any(e["first"] for e in drafted[1:])
    assert drafted[0]["rows_in"] > 1  # the prompt


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_mixed_drafter_kinds_are_flagged_on_a_gpu(monkeypatch, backend):
    """A DSpark and a DFlash recipe in one bench: a warning on GPU backends (measured there to
    slow the runs after a switch of kind), none on the CPU; one kind alone: none."""
    from types import SimpleNamespace

    from dspark_flow.bench import plan
    from dspark_flow.models import backend as backend_module
    from dspark_flow.recipe.load import load_recipe

    monkeypatch.setattr(backend_module, "backend_name", lambda: backend)
    warnings: list[str] = []
    monkeypatch.setattr(
        plan, "log", SimpleNamespace(warning=lambda event, **_: warnings.append(event))
    )
    both = [load_recipe(RECIPES / name) for name in ("dspark.yaml", "dflash.yaml")]
    for recipes, warned in ((both, backend == "cuda"), (both[:1], False)):
        warnings.clear()
        modes = [SimpleNamespace(pipeline=SimpleNamespace(recipe=r)) for r in recipes]
        plan._warn_mixed_drafter_kinds(SimpleNamespace(modes=modes, label="target"))
        assert any("DSpark and DFlash" in w for w in warnings) == warned
