"""draft_cap `calibrated`: the k with the most expected tokens per second on this machine.

The target's verify cost per draft length (at a few context depths) and the drafter's cost are
measured once per machine, model, weight format and drafter, and cached (see
`dspark_flow.calibration`); each round picks the k maximising (1 + p + ... + p^k) / round time
for the configured acceptance p at the current context depth. It always drafts (k >= 1), even
where every k is expected to be slower than plain decoding: `auto` is the cap that turns
drafting off where it loses, and back on.
"""

from __future__ import annotations

from typing import Literal

from dspark_flow.calibration.controller import CurveCap, CurveCapConfig


class CalibratedCapConfig(CurveCapConfig):
    kind: Literal["calibrated"] = "calibrated"


class CalibratedCap(CurveCap):
    Config = CalibratedCapConfig
    config: CalibratedCapConfig
