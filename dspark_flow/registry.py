"""Strategy registry over the entry-point group `dspark_flow.strategies`.

Entry points are named `<slot>.<kind>`; the built-in strategies register through the same group as
third-party packages. Listing reads distribution metadata only; a strategy's module is imported
when a recipe names its kind.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Literal

from dspark_flow.env import env_flag
from dspark_flow.errors import RegistryError
from dspark_flow.strategy import SLOTS, Strategy, StrategyConfig

GROUP = "dspark_flow.strategies"
OWN_DISTRIBUTION = "dspark-flow"


@dataclass(frozen=True)
class KindInfo:
    slot: str
    kind: str
    target: str  # "module:attr"
    distribution: str
    version: str

    @property
    def source(self) -> str:
        return f"{self.distribution} {self.version}"


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def plugins_disabled() -> bool:
    return env_flag("DSPARK_FLOW_DISABLE_PLUGINS")


@functools.lru_cache(maxsize=1)
def _scan() -> tuple[dict[str, dict[str, list[KindInfo]]], tuple[str, ...]]:
    """All claims per slot and kind, plus names that are not `<slot>.<kind>`."""
    claims: dict[str, dict[str, list[KindInfo]]] = {slot: {} for slot in SLOTS}
    malformed: list[str] = []
    seen: set[tuple[str, str]] = set()
    for ep in entry_points(group=GROUP):
        dist_name, version = _dist_of(ep)
        if plugins_disabled() and _normalise(dist_name) != OWN_DISTRIBUTION:
            continue
        slot, _, kind = ep.name.partition(".")
        if slot not in claims or not kind:
            malformed.append(f"{ep.name} ({dist_name})")
            continue
        # The same distribution can be visible twice (e.g. an editable install on sys.path).
        if (ep.name, _normalise(dist_name)) in seen:
            continue
        seen.add((ep.name, _normalise(dist_name)))
        claims[slot].setdefault(kind, []).append(KindInfo(slot, kind, ep.value, dist_name, version))
    return claims, tuple(malformed)


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", "?"
    return dist.metadata["Name"] or "unknown", dist.version or "?"


def refresh() -> None:
    """Forget the scanned entry points (after installing a plugin at run time, or in tests)."""
    _scan.cache_clear()
    load_kind.cache_clear()


def installed(slot: str | None = None) -> list[KindInfo]:
    """Every installed kind (first claim of each), without importing anything."""
    claims, _ = _scan()
    slots = [slot] if slot else list(SLOTS)
    out: list[KindInfo] = []
    for s in slots:
        if s not in claims:
            raise RegistryError(f"unknown slot '{s}'; slots: {', '.join(SLOTS)}")
        out.extend(infos[0] for _, infos in sorted(claims[s].items()))
    return out


def claims(slot: str) -> list[KindInfo]:
    """Every claim of every kind in `slot`, a kind that two distributions claim twice (the
    reference page shows each; a recipe naming it is refused), without importing anything."""
    found, _ = _scan()
    if slot not in found:
        raise RegistryError(f"unknown slot '{slot}'; slots: {', '.join(SLOTS)}")
    return [info for _, infos in sorted(found[slot].items()) for info in infos]


def conflicts() -> list[tuple[str, str, list[KindInfo]]]:
    claims, _ = _scan()
    return [
        (slot, kind, infos)
        for slot in SLOTS
        for kind, infos in sorted(claims[slot].items())
        if len(infos) > 1
    ]


def malformed() -> tuple[str, ...]:
    """Entry-point names in the group that are not `<slot>.<kind>` (with their distribution)."""
    return _scan()[1]


def kind_names(slot: str) -> list[str]:
    return [info.kind for info in installed(slot)]


def is_builtin(info: KindInfo) -> bool:
    """Registered by dspark-flow itself, not by a plugin."""
    return _normalise(info.distribution) == OWN_DISTRIBUTION


def describe_installed(slot: str) -> str:
    """`none, lookup, acme_tree (acme-spec 0.1.0)`: third-party kinds name their source."""
    parts = []
    for info in installed(slot):
        parts.append(info.kind if is_builtin(info) else f"{info.kind} ({info.source})")
    return ", ".join(parts) or "(none)"


def missing_kind_message(slot: str) -> str:
    return f"missing 'kind' (installed: {describe_installed(slot)})"


def unknown_kind_message(slot: str, kind: str) -> str:
    names = kind_names(slot)
    close = difflib.get_close_matches(kind, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown {slot} '{kind}'{hint} (installed: {describe_installed(slot)})"


def lookup(slot: str, kind: str) -> KindInfo:
    claims, _ = _scan()
    if slot not in claims:
        raise RegistryError(f"unknown slot '{slot}'; slots: {', '.join(SLOTS)}")
    infos = claims[slot].get(kind)
    if not infos:
        raise RegistryError(unknown_kind_message(slot, kind))
    if len(infos) > 1:
        who = " and ".join(info.source for info in infos)
        raise RegistryError(
            f"{slot} '{kind}' is claimed by two distributions: {who}; uninstall one "
            "(or set DSPARK_FLOW_DISABLE_PLUGINS=1 to use only the built-in kinds)"
        )
    return infos[0]


@functools.cache
def load_kind(slot: str, kind: str) -> type[Strategy]:
    """Import the strategy class registered as `<slot>.<kind>`."""
    return load_claim(lookup(slot, kind))


def load_claim(info: KindInfo) -> type[Strategy]:
    """Import the strategy class of one distribution's claim (`load_kind` refuses a kind that
    two distributions claim; the reference page still shows each)."""
    slot, kind = info.slot, info.kind
    module_name, _, attr = info.target.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
    # A broken plugin must not take the whole tool down with a traceback, nor end it
    # silently by calling sys.exit() at import (SystemExit is no Exception).
    except (Exception, SystemExit) as exc:
        raise RegistryError(
            f"{slot} '{kind}' from {info.source} failed to import ({info.target}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, Strategy) and obj.slot == slot):
        raise RegistryError(
            f"{slot} '{kind}' from {info.source} points at {info.target}, "
            f"which is not a {slot} strategy class"
        )
    config = getattr(obj, "Config", None)
    if not (isinstance(config, type) and issubclass(config, StrategyConfig)):
        # Recipes validate a section through Config.model_validate: anything else would fail
        # there as an internal error without the plugin's name.
        raise RegistryError(
            f"{slot} '{kind}' from {info.source}: {info.target}.Config is not a "
            "StrategyConfig (the pydantic model of its recipe section)"
        )
    kind_field = config.model_fields.get("kind")
    if kind_field is None or kind_field.annotation != Literal[kind]:
        # A section names its kind: the recipe's schema tells kinds apart by this Literal, and
        # any other would fail a correct recipe ("Input should be 'other'") or the schema.
        raise RegistryError(
            f"{slot} '{kind}' from {info.source}: {info.target}.Config must declare "
            f"kind: Literal[{kind!r}] (the name it is registered under)"
        )
    return obj


def source_of(slot: str, kind: str) -> str:
    """`from acme-spec 0.1.0` for an installed kind; empty when it is not (an object a caller
    built from an unregistered class)."""
    try:
        return f" from {lookup(slot, kind).source}"
    except RegistryError:  # unknown or claimed twice: nothing to name
        return ""
