"""draft_cap `auto`: `calibrated`, with the acceptance learnt from every round.

Each round's (proposed, accepted) updates a forgetting estimate of the per-position acceptance
p (see `AcceptanceEstimator`), and k is re-picked from the measured curves. When no k is
expected to beat plain decoding (gain < `min_gain`), and the evidence is firm about it (even the
`off_confidence` quantile of each acceptance rate would not pay), it drafts nothing,
except a short probe every `probe_every` rounds or more, so that it notices when drafts start
matching again. With a drafter that sizes its own drafts (`Drafter.sizes_own_drafts`: lookup)
it decides only whether to draft, and lets the drafter fill up to the limit. Each round's
measured time also updates how far this process's rounds run from what the curves charge
(`RoundCostOffset`: the host's speed moves between calibration and use), and that gap is added
to every cost it plans with (`learn_round_cost: false` plans with the curves alone;
`round_cost_by_rows: true` learns a ratio per row count instead, drafting rounds apart from
plain steps: `RoundCostRatios`, off by default: measured on the CPU and the H200 and not
adopted, docs/benchmarks.md §3). With
`plan_sources_apart: true`, rounds that copy a run from the context (a block drafter's
`prompt_lookup`) have their own estimate and on/off state and are charged no drafter pass.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from dspark_flow.calibration.controller import AdaptiveCapConfig, CurveCap


class AutoCapConfig(AdaptiveCapConfig):
    kind: Literal["auto"] = "auto"


class AutoCap(CurveCap):
    adaptive: ClassVar[bool] = True
    Config = AutoCapConfig
    config: AutoCapConfig
