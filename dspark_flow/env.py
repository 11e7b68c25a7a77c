"""Yes/no switches read from the environment, read alike everywhere: 1, true, yes or on (any
case) mean yes; anything else, unset included, means no (so DSPARK_FLOW_DEBUG=0 is off)."""

from __future__ import annotations

import os

TRUE = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE
