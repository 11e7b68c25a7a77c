"""Pick the compute backend and the weight format that runs fastest on it.

The mlx[cpu] wheel for Linux links libmlx.so against a bundled *reference* BLAS; its
`cblas_sgemm` is unversioned, so if a real BLAS is already in the global symbol scope when
libmlx.so is loaded, the dynamic linker binds to that one instead. `prefer_openblas()` puts
Debian's OpenBLAS there. It must run before `mlx.core` is first imported, which is why this
module imports mlx only inside functions.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

from dspark_flow.env import env_flag
from dspark_flow.errors import ModelError

OPENBLAS_HINT = (
    "OpenBLAS not active: float32 matmuls on the MLX CPU backend use the slow reference BLAS; "
    "install it with `apt-get install libopenblas0-pthread` (Debian/Ubuntu)"
)
# When OpenBLAS was there but came too late, or was turned off, installing it fixes nothing.
_FIX_FOR_REASON = {
    "too late": "import dspark_flow before mlx (OpenBLAS must be loaded before mlx.core)",
    "disabled": "unset DSPARK_FLOW_NO_OPENBLAS",
}
WEIGHT_FORMATS = ("auto", "native", "float32", "bfloat16", "float16")

# What prefer_openblas() did, for blas_status(): path loaded, or why not.
_state: dict[str, Any] = {"path": None, "reason": "not attempted"}


def _openblas_candidates() -> list[str]:
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(
        platform.machine(), f"{platform.machine()}-linux-gnu"
    )
    paths = [
        f"/usr/lib/{triplet}/libopenblas.so.0",  # Debian/Ubuntu (alternatives symlink)
        f"/usr/lib/{triplet}/openblas-pthread/libopenblas.so.0",
        "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL pthread build
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",  # Arch, Alpine
    ]
    found = [p for p in paths if os.path.exists(p)]
    if name := ctypes.util.find_library("openblas"):
        found.append(name)
    return found


def prefer_openblas() -> str | None:
    """Load OpenBLAS globally so libmlx.so binds its cblas_* calls to it; returns the path or None.

    No-op off Linux, with DSPARK_FLOW_NO_OPENBLAS=1, or once mlx.core is already imported
    (its symbols are bound by then); the reason is kept for blas_status().
    """
    if _state["path"] is not None:
        return _state["path"]
    if not sys.platform.startswith("linux"):
        _state["reason"] = f"not needed on {sys.platform}"
        return None
    if env_flag("DSPARK_FLOW_NO_OPENBLAS"):
        _state["reason"] = "disabled by DSPARK_FLOW_NO_OPENBLAS=1"
        return None
    if "mlx.core" in sys.modules:
        _state["reason"] = "too late: mlx.core was imported before prefer_openblas()"
        return None
    for path in _openblas_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _state.update(path=path, reason="loaded")
        return path
    _state["reason"] = "libopenblas.so.0 not found"
    return None


def _mapped_openblas() -> str | None:
    """Path of an OpenBLAS mapped into this process (ours, LD_PRELOAD, or numpy's), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if "libopenblas" in line and "/" in line:
            return line[line.index("/") :]
    return None


def blas_status() -> dict[str, Any]:
    """Whether float32 matmuls on the CPU go through OpenBLAS, and how to fix it if not."""
    if not sys.platform.startswith("linux"):
        return {"openblas": False, "active": None, "reason": _state["reason"], "hint": None}
    mapped = _mapped_openblas()
    # libmlx binds cblas_* once, when it loads: only an OpenBLAS already in the global scope
    # then counts (ours, or LD_PRELOAD). One mapped later, or numpy's (its symbols carry a
    # suffix), leaves the reference BLAS in place.
    active = _state["reason"] == "loaded" or "openblas" in os.environ.get("LD_PRELOAD", "")
    fix = next((f for why, f in _FIX_FOR_REASON.items() if _state["reason"].startswith(why)), None)
    if fix and not _openblas_candidates():  # nothing to load in any order: install it first
        fix = None
    hint = OPENBLAS_HINT if fix is None else f"OpenBLAS not active ({_state['reason']}): {fix}"
    return {
        "openblas": mapped,
        "active": active,
        "reason": _state["reason"],
        "hint": None if active else hint,
    }


def warn_if_slow_blas(fmt: str) -> str | None:
    """The warning a float32 model on the Linux CPU backend deserves without OpenBLAS (verifying
    K tokens then costs K times one, so speculation cannot pay), logged once; returns it."""
    if fmt != "float32" or not sys.platform.startswith("linux") or backend_name() != "cpu":
        return None
    status = blas_status()
    if status["active"]:
        return None
    message = f"speculative decoding cannot pay on the CPU here. {status['hint']}"
    if not _state.get("warned"):
        from dspark_flow.log import get_logger

        get_logger().warning("slow_blas", message=message)
        _state["warned"] = True
    return message


def release_thread_streams() -> None:
    """Destroy the MLX streams the calling thread created. Call it last on any thread that ran
    MLX work: streams left to interpreter exit abort the process (exit 134, "terminate called
    without an active exception"; ml-explore/mlx#3126). The main thread needs no call."""
    import mlx.core as mx

    clear = getattr(mx, "clear_streams", None)  # absent from older MLX: nothing to clear there
    if callable(clear):
        clear()


PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"


def keep_compiled_kernels() -> str | None:
    """Point MLX's on-disk cache of CUDA kernels under dspark-flow's home unless the user
    set one ($MLX_PTX_CACHE_DIR); returns the directory chosen, or None.

    Why: MLX compiles some kernels with NVRTC on first use (fused elementwise kernels of
    `mx.compile`, gathers: 62-70 s of a new process's start on a fresh H200, 2026-12-02)
    and caches them under the system temp directory, which a reboot or a new container empties.
    MLX reads the variable at its first compilation, so this runs before any model loads. Keyed
    by MLX version and the device's architecture: compiled kernels fit one GPU generation, and
    a home may be shared by machines with others. No effect off CUDA; MLX creates the
    directory, and runs uncached if it cannot."""
    if os.environ.get(PTX_CACHE_ENV):
        return None
    import mlx.core as mx

    from dspark_flow.models.embedded import cache_root

    version = str(getattr(mx, "__version__", "unknown"))
    path = cache_root() / "mlx-kernels" / version / device_key()
    os.environ[PTX_CACHE_ENV] = str(path)
    return str(path)


def device_key() -> str:
    """The default device's architecture (e.g. sm_90 on an H200), as a file name."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    name = str(info.get("architecture") or info.get("device_name") or "unknown")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "unknown"


def backend_name() -> str:
    """'cpu', 'metal' or 'cuda': where mlx runs by default."""
    import mlx.core as mx

    device = mx.default_device()
    if getattr(device, "type", None) == getattr(mx, "cpu", object()):
        return "cpu"
    metal = getattr(mx, "metal", None)
    if metal is not None and getattr(metal, "is_available", lambda: False)():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and getattr(cuda, "is_available", lambda: False)():
        return "cuda"
    return "cpu"


def mlx_version() -> str:
    """MLX's version (the stubs of mlx.core leave `__version__` out)."""
    import mlx.core as mx

    return str(getattr(mx, "__version__", "unknown"))


def choose_weight_format(requested: str) -> str:
    """Resolve 'auto': float32 on CPU, native (quantized) on GPUs.

    Measured on the MLX CPU backend: a 4-bit matmul costs about K times a single row (no
    batched kernel), while float32 through OpenBLAS is nearly flat in K, which is what
    speculative verification needs.
    """
    if requested not in WEIGHT_FORMATS:
        raise ModelError(
            f"unknown weight format {requested!r}; use one of {', '.join(WEIGHT_FORMATS)}"
        )
    if requested != "auto":
        return requested
    return "float32" if backend_name() == "cpu" else "native"


def apply_weight_format(model: Any, fmt: str) -> Any:
    """Convert `model` in place to `fmt` ('native', 'float32', 'bfloat16', 'float16'); returns it."""
    import mlx.core as mx

    if fmt == "native":
        if backend_name() == "cpu":
            # float16 scales/activations take a slow path on the CPU backend (~32x for 4-bit).
            model.set_dtype(mx.float32)
        else:
            from dspark_flow.models.scales import widen_scales_to_activations

            widen_scales_to_activations(model)  # exact; saves two copies per matmul call
        return model
    dtypes = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if fmt not in dtypes:
        raise ModelError(f"unknown weight format {fmt!r}")
    return dequantize_model(model, dtypes[fmt])


def dense_weight(module: Any) -> Any:
    """The float32 weight of a Linear/Embedding, dequantized when it is quantized (in float32,
    as llama.cpp does: float16 scales would round every weight)."""
    import mlx.core as mx

    if "scales" not in module:
        return module.weight.astype(mx.float32)
    biases = module.get("biases")
    return mx.dequantize(
        module.weight,
        module.scales.astype(mx.float32),
        None if biases is None else biases.astype(mx.float32),
        group_size=module.group_size,
        bits=module.bits,
        mode=getattr(module, "mode", "affine"),
    )


def dequantize_model(model: Any, dtype: Any) -> Any:
    """Replace every QuantizedLinear/QuantizedEmbedding of `model` by its float twin and cast the
    float parameters to `dtype` (an mx.Dtype), in place; returns it."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map_with_path

    def dequantized(_path: str, m: Any) -> Any:
        switch = type(m).__name__ == "QuantizedSwitchLinear"  # mlx-lm's mixture-of-experts
        if not (switch or isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))):
            return m
        w = dense_weight(m).astype(dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            new: Any = nn.Embedding(*w.shape)
        elif switch:
            from mlx_lm.models.switch_layers import SwitchLinear

            new = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in m)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
        if "bias" in m and not isinstance(m, nn.QuantizedEmbedding):
            new.bias = m.bias.astype(dtype)
        new.weight = w
        return new

    leaves = tree_map_with_path(dequantized, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    if kept := [name for name, m in model.named_modules() if "scales" in m]:
        # a quantized layer of a kind this does not know: it keeps its K-times verify cost
        from dspark_flow.log import get_logger

        get_logger().warning(
            "layers stay quantized", count=len(kept), first=kept[0], dtype=str(dtype)
        )
    model.set_dtype(dtype)  # norms and any other float params; ints are left alone
    mx.eval(model.parameters())
    return model
