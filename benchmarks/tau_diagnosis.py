"""Where a trained drafter's acceptance goes: teacher-forced against decoded, training-split
prompts against held-out ones (issue 5's "what limited it").

For each prompt the target's greedy answer is decoded speculatively (full block, the product's
loop: decoded τ), then the same sequence goes through the drafter's training pass with an anchor
at every answer position: the teacher-forced τ averages over all anchors (the training log's
figure), and walking those anchors as decoding does (next anchor after each accepted run) gives a
simulated τ that should equal the decoded one if training and inference agree. Training-split
prompts against held-out ones tells over-fitting from under-fitting.

    python benchmarks/tau_diagnosis.py --per-category 6    # CPU: ~4 min

`--lookup` adds prompt lookup: walked beside the chain on the same sequences (LOOKUP_SHAPES), and
decoded for real with the drafter's `prompt_lookup` on (its output checked equal).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)
import dspark_flow.training.trainer as trainer_module
from dspark_flow.api import load_drafter, speculative_generate
from dspark_flow.models.drafter_loading import quantize_as_stored
from dspark_flow.training.blocks import sample_blocks
from dspark_flow.training.data import Sample, _encode, read_prompts
from dspark_flow.training.recipe import PromptFile, load_train_recipe
from dspark_flow.training.warm_start import start_from

# name -> top-m per slot (slots past the list: top-1)
BRANCH_SHAPES = {
    "one chain": [1],
    "top-2 first slot": [2],
    "top-3 first slot": [3],
    "top-2 first two slots": [2, 2],
    "top-2 every slot": [2] * 16,
}
# name -> (lookup's shortest match to take its draft over the chain, its draft cap);
# None: the longer of the two (both verified: a two-branch tree)
LOOKUP_SHAPES = {
    "lookup alone": (0, 7),
    "lookup where it matches >= 2, else chain": (2, 7),
    "lookup where it matches >= 4, else chain": (4, 7),
    "lookup where it matches >= 4 (up to 15), else chain": (4, 15),
    "the longer of lookup and chain (two branches)": None,
}
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT.parent / "shared" / "data" / "prompts"


def prompt_sets(n: int) -> dict[str, PromptFile]:
    return {
        "train gsm8k": PromptFile(path=str(PROMPTS / "gsm8k.jsonl"), lines="1-1000", limit=n),
        "train mbpp": PromptFile(path=str(PROMPTS / "mbpp.jsonl"), limit=n),
        "held-out chat": PromptFile(path=str(PROMPTS / "mt-bench.jsonl"), limit=n),
        "held-out code": PromptFile(path=str(PROMPTS / "humaneval.jsonl"), limit=n),
        "held-out math": PromptFile(path=str(PROMPTS / "gsm8k.jsonl"), lines="1001-", limit=n),
    }


def main() -> int:
    import mlx.core as mx  # after dspark_flow (OpenBLAS first)
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/train/smollm2-135m-dspark.yaml"))
    ap.add_argument("--drafter", default=None, help="drafter dir (default: the recipe's output)")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    ap.add_argument(
        "--lookup",
        action="store_true",
        help="also walk prompt lookup beside the chain, and decode with the drafter's "
        "prompt_lookup on",
    )
    ap.add_argument("--only", default="", help="only the prompt sets whose name holds this")
    args = ap.parse_args()

    recipe = load_train_recipe(args.recipe)
    shipped = Path(args.drafter or recipe.output)
    ranks: dict[str, mx.array] = {}
    original = trainer_module.draft_losses

    def keep_ranks(logits, labels, weights, *rest, **kw):  # noqa: ANN001, ANN202
        # The label's rank among the slot's logits (0: the argmax, the training pass's own hit
        # test); slots without a label rank past every shape.
        label = mx.take_along_axis(logits, labels[..., None], axis=-1)
        ranks["last"] = mx.where(weights > 0, (logits > label).sum(-1), 1 << 30)
        return original(logits, labels, weights, *rest, **kw)

    trainer_module.draft_losses = keep_ranks
    tr = trainer_module.DrafterTrainer(recipe, progress=False).warm_up()
    start_from(tr.model, tr.spec, shipped, recipe.drafter.kind, tr.mask_id, tr.compute_dtype)
    as_shipped = quantize_as_stored(shipped)
    drafter = load_drafter(str(shipped), tr.target, quantize=as_shipped)
    copying = (
        load_drafter(str(shipped), tr.target, quantize=as_shipped, prompt_lookup=True)
        if args.lookup
        else None
    )
    first = tr.first_slot
    rows = {}
    for name, spec in prompt_sets(args.per_category).items():
        if args.only not in name:
            continue
        dec, forced, dec_copy = [], [], []
        shapes = list(BRANCH_SHAPES) + (list(LOOKUP_SHAPES) if args.lookup else [])
        walked: dict[str, list[int]] = {shape: [] for shape in shapes}
        for prompt in read_prompts(spec):
            res = speculative_generate(
                tr.target, tr.tokenizer, drafter, prompt,
                max_new_tokens=args.max_tokens, max_draft_tokens=None,
            )  # fmt: skip
            dec += res.accept_lengths
            if args.lookup:
                copied = speculative_generate(
                    tr.target, tr.tokenizer, copying, prompt,
                    max_new_tokens=args.max_tokens, max_draft_tokens=None,
                )  # fmt: skip
                assert copied.token_ids == res.token_ids, "prompt lookup changed the output"
                dec_copy += copied.accept_lengths
            prompt_ids = _encode(tr.tokenizer, prompt, None)
            tokens = np.array(prompt_ids + list(res.token_ids), dtype=np.int32)
            b = sample_blocks(
                [Sample(tokens=tokens, prompt_len=len(prompt_ids), source=name)],
                seq_len=len(tokens), anchors=len(res.token_ids) - 1,
                block_size=recipe.drafter.block_size, first_slot=first,
                mask_token_id=tr.mask_id, pad_id=tr.pad_id, rng=np.random.default_rng(0),
            )  # fmt: skip
            feats, t_logits = tr._target_pass(mx.array(b.tokens), mx.array(b.aligned))
            arrays = (b.block_ids, b.block_pos, b.mask, b.labels, b.prev, b.weights)
            tr._loss(tr.model, feats, t_logits, *map(mx.array, arrays))
            rank = np.array(ranks["last"][0])  # (anchors in order, slots)
            forced += (np.cumprod(rank == 0, axis=-1).sum(-1) + 1).tolist()
            for shape, tops in BRANCH_SHAPES.items():
                limit = np.array((tops + [1] * rank.shape[-1])[: rank.shape[-1]])
                walked[shape] += _walk(np.cumprod(rank < limit, axis=-1).sum(-1).tolist())
            if args.lookup:
                chain = np.cumprod(rank == 0, axis=-1).sum(-1).tolist()
                found = _lookup_runs(tokens.tolist(), len(prompt_ids), len(chain))
                for shape, rule in LOOKUP_SHAPES.items():
                    walked[shape] += _walk([_pick(rule, c, f) for c, f in zip(chain, found)])
        rows[name] = {
            "decoded": float(np.mean(dec)),
            "simulated": float(np.mean(walked["one chain"])),
            "teacher_forced": float(np.mean(forced)),
            "branches": {shape: float(np.mean(w)) for shape, w in walked.items()},
        }
        if dec_copy:
            rows[name]["decoded with prompt lookup"] = float(np.mean(dec_copy))
        flat = {k: v for k, v in rows[name].items() if k != "branches"} | rows[name]["branches"]
        print(name, {k: round(v, 2) for k, v in flat.items()}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def _lookup_runs(tokens: list[int], prompt_len: int, anchors: int) -> list[tuple[int, int, int]]:
    """At each anchor (answer position), prompt lookup's draft of up to 15 tokens, found as the
    product's `lookup` drafter finds it: (its match length, tokens it got right at a cap of 7,
    at a cap of 15)."""
    from dspark_flow.strategies.drafters.lookup import LookupConfig, find_copy
    from dspark_flow.strategy import accepted_prefix

    search = LookupConfig()
    out = []
    for j in range(anchors):
        a = prompt_len + j
        draft, match = find_copy(tokens[: a + 1], 15, search)
        right = accepted_prefix(draft, tokens[a + 1 : a + 16])
        out.append((match, min(right, 7), right))
    return out


def _pick(rule: tuple[int, int] | None, chain: int, found: tuple[int, int, int]) -> int:
    """Drafts accepted at one anchor under a lookup rule (LOOKUP_SHAPES)."""
    match, right7, right15 = found
    if rule is None:
        return max(chain, right7)
    least, cap = rule
    if match and match >= least:
        return right7 if cap == 7 else right15
    return chain if least else 0


def _walk(runs: Sequence[int]) -> list[int]:
    """Tokens per round where decoding's anchors fall: one after each accepted run."""
    out, i = [], 0
    while i < len(runs):
        out.append(int(runs[i]) + 1)
        i += int(runs[i]) + 1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
