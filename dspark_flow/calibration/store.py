"""The on-disk cache of measured curves: one JSON file per key, written atomically.

A key holds everything that changes the curves: the target (reference, revision, a hash of its
config.json and weight file sizes, plus a fingerprint of the loaded architecture), the weight
format, the drafter (kind, config, checkpoint), the MLX version, backend, device and BLAS, and
the calibration settings. A missing, corrupt, wrong-version or mismatched file means "measure
again and replace it"; nothing in the cache can make a run fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dspark_flow.calibration.curves import Curves
from dspark_flow.files import acquire_saying_why, write_text_atomic
from dspark_flow.log import get_logger

log = get_logger()

# Bump when the file layout or the meaning of a curve changes. 2: the kernels verifier's
# invariant mode now runs on the CPU too (MLX's attention and matmuls in chunks of their
# row-invariant spans), so a CPU verify curve cached before times another forward. 3: a feature
# drafter's curve includes taking one new row into its context per proposal, as in the loop.
VERSION = 3
ENV_DIR = "DSPARK_FLOW_CALIBRATION_DIR"  # separate from DSPARK_FLOW_HOME (which moves models too)


def calibration_dir() -> Path:
    """$DSPARK_FLOW_CALIBRATION_DIR, else <cache_root()>/calibration."""
    from dspark_flow.models.embedded import cache_subdir

    return cache_subdir(ENV_DIR, "calibration")


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


# -- identities --------------------------------------------------------------------------------


def architecture_fingerprint(model: Any) -> str:
    """Hash of the model's args and every parameter's path, shape and dtype (not values: the
    curves depend on what is computed, not on the numbers)."""
    from dspark_flow.arrays import named_arrays

    args = getattr(model, "args", None)
    args_data = vars(args) if args is not None and hasattr(args, "__dict__") else repr(args)
    params = [(p, list(v.shape), str(v.dtype)) for p, v in named_arrays(model.parameters())]
    return _sha256_text(json.dumps([_jsonable(args_data), sorted(params)], default=str))[:16]


def weight_format(model: Any) -> str:
    """What the loaded weights are, e.g. 'float32' or 'q4:64+float32' (bits:group + float dtype)."""
    import mlx.nn as nn

    from dspark_flow.arrays import named_arrays

    quant = sorted(
        {
            f"q{m.bits}:{m.group_size}"
            for _, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        }
    )
    floats = Counter(
        str(v.dtype).removeprefix("mlx.core.")
        for _, v in named_arrays(model.parameters())
        if "float" in str(v.dtype)
    )
    main = floats.most_common(1)[0][0] if floats else "none"
    return "+".join([*quant, main])


def _model_dir(ref: str, revision: str | None) -> Path | None:
    """The local directory of an already fetched model, without fetching anything."""
    try:
        if ref.startswith("builtin:"):  # a shipped drafter, or a model already built: never
            # download or convert for a key
            from dspark_flow.models.embedded import cache_root
            from dspark_flow.models.loading import SHIPPED_DRAFTERS

            name = ref.removeprefix("builtin:")
            for found in (SHIPPED_DRAFTERS / name, cache_root() / "models" / name):
                if (found / "config.json").is_file():
                    return found
            return None
        local = Path(ref).expanduser()
        if local.is_dir():
            return local
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                ref, revision=revision, allow_patterns=["*.json"], local_files_only=True
            )
        )
    except Exception:  # unknown/offline: the in-memory fingerprint still identifies the model
        return None


def checkpoint_identity(ref: str, revision: str | None = None) -> dict[str, Any]:
    """Reference, revision, and (when its files are at hand) config hash and weight file sizes."""
    ident: dict[str, Any] = {"ref": ref, "revision": revision}
    path = _model_dir(ref, revision)
    if path is not None and (path / "config.json").is_file():
        ident["config_sha256"] = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
        ident["weight_sizes"] = {
            f.name: f.stat().st_size
            for f in sorted(path.iterdir())
            if f.suffix in (".safetensors", ".gguf", ".npz", ".bin")
        }
    return ident


def model_identity(
    model: Any, ref: str | None = None, revision: str | None = None
) -> dict[str, Any]:
    ident: dict[str, Any] = {"architecture": architecture_fingerprint(model)}
    if ref:
        ident.update(checkpoint_identity(ref, revision))
    return ident


def drafter_identity(drafter: Any) -> dict[str, Any]:
    config = getattr(drafter, "config", None)
    ident: dict[str, Any] = {
        "kind": getattr(config, "kind", type(drafter).__name__),
        "class": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
    }
    if config is not None and hasattr(config, "model_dump"):
        neutral = set(getattr(config, "COST_NEUTRAL", ()))
        ident["config"] = _jsonable(config.model_dump(mode="json", exclude=neutral))
        ref = getattr(config, "model", None) or getattr(config, "checkpoint", None)
        if isinstance(ref, str) and not ref.startswith("<") and ref != "auto":  # no files
            ident["checkpoint"] = checkpoint_identity(ref, getattr(config, "revision", None))
    inner = getattr(drafter, "model", None)
    if inner is not None and hasattr(inner, "parameters"):
        ident["architecture"] = architecture_fingerprint(inner)
    return ident


# What mx.device_info() reports that is not the kind of device: free memory changes from one
# process to the next (on CUDA it keyed every run apart, so every run measured its curves again,
# 2026-11-30), and a card's uuid and bus id would make identical cards measure twice.
VOLATILE_DEVICE_FIELDS = frozenset({"free_memory", "uuid", "pci_bus_id"})


THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def machine_identity() -> dict[str, Any]:
    import mlx.core as mx

    from dspark_flow.models.backend import backend_name, blas_status, mlx_version

    try:
        device = {k: v for k, v in mx.device_info().items() if k not in VOLATILE_DEVICE_FIELDS}
    except Exception:
        device = {}
    blas = blas_status()
    return {
        "mlx": mlx_version(),
        "backend": backend_name(),
        "device": _jsonable(device),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "blas": blas.get("openblas") if blas.get("active") else None,
        **(_cpu_threads() if backend_name() == "cpu" else {}),
    }


def _cpu_threads() -> dict[str, Any]:
    """What the CPU backend's verify curves scale with: the cores this process may use, and
    BLAS's threads (a GPU's do not: keying them would measure again per launcher)."""
    return {
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": {k: os.environ.get(k) for k in THREAD_VARIABLES if os.environ.get(k)},
    }


def make_key(
    model: Any,
    drafter: Any,
    *,
    target_ref: str | None = None,
    target_revision: str | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The full key for these curves (JSON-able; compared whole on load)."""
    return _jsonable(
        {
            "target": model_identity(model, target_ref, target_revision),
            "weights": weight_format(model),
            "drafter": drafter_identity(drafter),
            "machine": machine_identity(),
            "settings": settings or {},
        }
    )


def key_digest(key: dict[str, Any]) -> str:
    return _sha256_text(json.dumps(key, sort_keys=True))[:24]


# -- the store ---------------------------------------------------------------------------------


def _check_covers(curves: Curves, settings: dict[str, Any]) -> None:
    """Curves that measure less than their key asked for (a damaged or hand-edited file) are
    not used: a cap would read the missing k as impossible and never draft them."""
    block = settings.get("block")
    if isinstance(block, int) and curves.block < block:
        raise ValueError(f"the curves cover k up to {curves.block}, the key asks for {block}")


class CurveStore:
    """JSON files `<dir>/<digest>.json` holding {"version", "key", "curves"}."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root).expanduser() if root is not None else calibration_dir()

    def path_for(self, key: dict[str, Any]) -> Path:
        return self.root / f"{key_digest(key)}.json"

    def load(self, key: dict[str, Any], quiet: bool = False) -> Curves | None:
        """The cached curves for `key`, or None when absent or unusable (never raises; `quiet`:
        a second look that would repeat the first one's warning)."""
        path = self.path_for(key)
        warn, info = (log.debug, log.debug) if quiet else (log.warning, log.info)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            warn("calibration cache unreadable, re-measuring", path=str(path), error=str(e))
            return None
        try:
            if data.get("version") != VERSION:
                info("calibration cache of another version, re-measuring", path=str(path))
                return None
            if data.get("key") != key:  # a digest collision or a hand-edited file
                return None
            curves = Curves.from_dict(data["curves"])
            _check_covers(curves, key.get("settings") or {})
            return curves
        except (AttributeError, KeyError, TypeError, ValueError, ArithmeticError) as e:
            # ArithmeticError: int(Infinity) and the like
            warn("calibration cache malformed, re-measuring", path=str(path), error=str(e))
            return None

    def save(self, key: dict[str, Any], curves: Curves) -> Path | None:
        """Write atomically and durably; a failure is logged, not raised."""
        path = self.path_for(key)
        payload = {"version": VERSION, "key": key, "curves": curves.to_dict()}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            text = json.dumps(payload, indent=1, sort_keys=True) + "\n"
            return write_text_atomic(text, path, durable=True)
        except OSError as e:
            log.warning("could not write calibration cache", path=str(path), error=str(e))
            return None

    def get(
        self, key: dict[str, Any], measure: Callable[[], Curves], force: bool = False
    ) -> tuple[Curves, bool, Path | None]:
        """Cached curves for `key`, else `measure()` them and cache them; returns (curves,
        measured, the file they are in: None when it could not be written)."""
        if not force and (cached := self.load(key)) is not None:
            return cached, False, self.path_for(key)
        with self._measuring(key):
            # Another process may have measured them while this one waited: two measuring at
            # once would time each other's load, and cache the slowed curves.
            if not force and (cached := self.load(key, quiet=True)) is not None:
                return cached, False, self.path_for(key)
            curves = measure()
            return curves, True, self.save(key, curves)

    @contextlib.contextmanager
    def _measuring(self, key: dict[str, Any]) -> Iterator[None]:
        """One process measures a key at a time: a lock file in the machine's temporary folder
        (the cache folder keeps only curves); where none can be taken, measure without it."""
        import tempfile

        from filelock import FileLock  # a huggingface_hub dependency, so always present

        name = f"dspark-flow-calibrating-{self.path_for(key).stem}.lock"
        lock = FileLock(str(Path(tempfile.gettempdir()) / name))
        held = True
        try:
            acquire_saying_why(
                lock,
                lambda: log.info("waiting for another process measuring the curves", lock=name),
            )
        except (OSError, NotImplementedError):  # no locking there (e.g. flock on some NFS)
            held = False
        try:
            yield
        finally:
            if held:
                lock.release()
