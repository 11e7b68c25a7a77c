"""Typed views of the MLX values the code reads on the host.

mlx.core's stubs type `item()` as int | float | complex, `tolist()` as a nested union, `mx.load`
as one of three shapes and `tree_flatten` as a list or a dict. Each caller knows which one it
has; these helpers say so in one place instead of a cast at every call. MLX is imported only
where a helper loads a file, so modules that load without MLX (strategy.py) can use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import mlx.core as mx


def as_int(a: mx.array) -> int:
    """A one-element integer array (a token id, a count) as a Python int."""
    return int(cast(int, a.item()))


def as_float(a: mx.array) -> float:
    """A one-element real array as a Python float."""
    return float(cast(float, a.item()))


def int_list(a: mx.array) -> list[int]:
    """A 1-D integer array (token ids) as a list of Python ints."""
    return cast(list[int], a.tolist())


def int_rows(a: mx.array) -> list[list[int]]:
    """A 2-D integer array (token ids per row) as lists of Python ints."""
    return cast(list[list[int]], a.tolist())


def load_arrays(path: str | Path) -> dict[str, mx.array]:
    """The named arrays of a .safetensors or .npz file."""
    import mlx.core as mx

    loaded = mx.load(str(path))
    if not isinstance(loaded, dict):  # a .npy file holds one unnamed array
        raise TypeError(f"{path}: expected named arrays, found a single array")
    return loaded


def load_with_metadata(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The named arrays and the metadata of a .safetensors or .gguf file."""
    import mlx.core as mx

    return cast(
        tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(path), return_metadata=True)
    )


def named_arrays(tree: Any) -> list[tuple[str, mx.array]]:
    """A parameter tree's leaves as (dotted name, array) pairs, as `tree_flatten` gives them."""
    from mlx.utils import tree_flatten

    return cast("list[tuple[str, mx.array]]", tree_flatten(tree))
