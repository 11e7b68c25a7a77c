"""verifier `kernels`: the reference forward, with the target's quantized matmuls and its
attention routed through `dspark_flow.kernels` for the shapes where a probe on this machine said
the kernel is correct and faster (see docs/kernels.md).

warm_up finds the target's quantized layers (QuantizedLinear, and a QuantizedEmbedding used as
the tied output head), runs one recording forward to learn each layer's activation dtype and the
attention's heads and dtype, then probes every verify shape (rows 1..max_rows: by default the
most the pipeline's drafter can ask, its largest draft + 1, and 16 in invariant mode) of every distinct
layer shape and every query count of the attention (per key-length bucket); verdicts are cached
per machine. In invariant mode each layer shape, and the attention, take one route for every
row count that computes each row alike (MLX's own kernels where the probe finds them
row-invariant, `qmv_rows`/`sdpa_vector_rows` past that where bitwise equal to them, or the
kernels above): MLX's own where they exist and are not far dearer (`prefer_stock`), else the
cheapest per token by the probes. Layers are rerouted by swapping their class to a subclass whose matmul asks the
router first; attention by wrapping the `scaled_dot_product_attention` function that mlx-lm's
model modules call (`dspark_flow/models/attention.py`: the wrapper passes through to the
original unless a forward set its hook; `restore()` undoes both). The router and its attention
hook are active only inside this verifier's `forward`, so
anything else running the same model gets the stock path. Where nothing is enabled nothing is
swapped or wrapped: output = `reference`. On the CPU no kernel runs; there invariant mode routes
the dense layers (and the tied head) and the attention through MLX's own ops in chunks of their
probed row-invariant spans (`_dense_routes`, `_chunked_attention`; a dense layer's lone row
padded to two instead where that makes its rows agree: `pad_rows`), the only exact routes there.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field

from dspark_flow.kernels.coprefill import coprefill_qmm, row_bucket
from dspark_flow.kernels.qmm_small_m import MAX_ROWS
from dspark_flow.log import get_logger
from dspark_flow.models.attention import (
    attention_hook,
    attention_modules,
    unwrap_attention,
    wrap_attention,
)
from dspark_flow.models.compiled_layers import CompiledLayers, compiled_scope
from dspark_flow.models.fused_projections import FusedProjections
from dspark_flow.strategies.verifiers.layer_options import LayerOptions
from dspark_flow.strategy import BuildContext, Verifier

log = get_logger()

_ROUTER: contextvars.ContextVar[_Router | None] = contextvars.ContextVar(
    "dspark_flow_kernel_router", default=None
)
_SUBCLASSES: dict[type, type] = {}


# `prefer_stock` keeps MLX's own route unless the probes time it this many times dearer per
# token than our kernel's. On the H200 (2026-12-01) the tied head's stock route timed 1.8x ours
# per token and ran faster end to end (benchmarks §4); MLX's matmul in chunks of one row (a
# span of 1 without an exact `qmv_rows`) would time ~2.9x for the head, more on cheaper shapes.
PREFER_STOCK_LIMIT = 2.5

# `pad_rows`: a dense layer whose span is under PAD_BELOW_SPAN rows would run its verifies in
# chunks of 1-2 rows (one matmul call per chunk); where its products agree from PAD_FLOOR rows
# on, a one-row forward takes a zero row and every verify runs one call. On a 2-core Xeon
# (2026-12-05, docs/kernels.md) the embedded target's down projection (span 1, floor 2): an
# 8-row verify -16%, one row +3% (one process); its q/o projections (span 2, floor 3: two zero
# rows) would add another +5% to one row for a few ms per verify, so they keep their chunks.
PAD_BELOW_SPAN = 3
PAD_FLOOR = 2


class KernelsConfig(LayerOptions):
    kind: Literal["kernels"] = "kernels"
    max_rows: int | None = Field(
        None,
        ge=1,
        le=MAX_ROWS,
        description="largest verify forward routed (rows); default: 16 in invariant mode, "
        "else the drafter's largest draft + 1 (1 without a drafter, 16 for an unbounded one), "
        "so a first warm-up probes only the shapes decoding can use",
    )
    min_gain: float = Field(0.05, ge=0.0, description="speedup over the twin a kernel needs")
    head: bool = Field(
        True,
        description="route the tied output head (a quantized embedding; on the CPU in "
        "invariant mode a float one too) as the other matmuls are routed",
    )
    matmuls: bool = Field(
        True,
        description="route the layers' matmuls (qmm_small_m; in invariant mode also qmv_rows, "
        "MLX's own in chunks, and on the CPU the dense layers' chunked route)",
    )
    attention: bool = Field(
        True,
        description="route verify-side attention (sdpa_small_q; in invariant mode also "
        "sdpa_vector_rows and, on the CPU, MLX's attention in chunks)",
    )
    invariant: bool = Field(
        False,
        description="give every layer and the attention one route for all row counts "
        "1..max_rows that computes each row alike (MLX's own kernels within their measured "
        "invariant span, bitwise twins of them past it, or our kernels; see prefer_stock; on "
        "the CPU MLX's own matmuls and attention in chunks of their spans): "
        "a token's logits then do not depend on how many tokens one forward holds, so "
        "speculation reproduces this verifier's own greedy output bit for bit",
    )
    prefer_stock: bool = Field(
        True,
        description="invariant mode: wherever MLX's own kernels (within their invariant span) "
        "and bitwise twins of them past it cover every row count, take that route unless the "
        "probes time it over 2.5 times as dear per token as our kernel's (where it covers every "
        "layer and the attention, a one-token forward is MLX's stock forward; on the H200 plain "
        "greedy +8%, speculation +2%: the probes time a kernel alone, not the host time its "
        "calls add to a forward); false: the cheapest per token by the probes",
    )
    pad_rows: bool = Field(
        True,
        description="invariant mode on the CPU: a dense layer that MLX computes alike from 2 "
        "rows on but not for a lone row (span 1-2 rows, so its verifies would run one matmul "
        "per 1-2 rows) pads a one-row input with a zero row, and every verify runs one matmul "
        "(measured on a 2-core Xeon: a verify of 8 rows -16%, a one-row forward +3%); false: "
        "chunks",
    )
    coprefill: bool = Field(False, description="probe CPU co-prefill for wide prefill matmuls")
    reprobe: bool = Field(False, description="ignore cached verdicts and measure again")
    precompile: bool = Field(
        True,
        description="where kernels are routed, run one throwaway forward per row count "
        "1..max_rows at warm-up, so first-use compilation (GPUs) happens there and not in "
        "the first requests",
    )


def _dense(module: nn.Module, head: bool) -> bool:
    """A float (unquantized) linear layer, or a float embedding (its `as_linear` is the tied
    output head) where `head` asks for the head too."""
    if isinstance(module, nn.QuantizedLinear) or "weight" not in module:
        return False
    float_weight = mx.issubdtype(module["weight"].dtype, mx.floating)
    return float_weight and (
        isinstance(module, nn.Linear) or (head and isinstance(module, nn.Embedding))
    )


def _quant_args(module: nn.Module) -> tuple[mx.array, mx.array | None, mx.array | None]:
    return module["weight"], module.get("scales"), module.get("biases")


def _in_features(module: nn.Module) -> int:
    """K of a routed layer: a quantized weight packs 32 // bits values per column."""
    bits = getattr(module, "bits", 0)
    return module["weight"].shape[1] * 32 // bits if bits else module["weight"].shape[1]


def _stock_then(span: int, fn: Callable[..., Any], top: int) -> list[Callable[..., Any] | None]:
    """A route by row count 0..top: MLX's own op (None) for rows up to `span`, `fn` past it."""
    return [None] * (span + 1) + [fn] * (top - span)


@dataclass(slots=True)
class _Route:
    """What one layer may take: its activation dtype, the matmul for each verify row count
    (`by_rows[r]`: a kernel's calling convention, None: the stock path), and CPU co-prefill
    shares by prefill row bucket."""

    dtype: mx.Dtype
    by_rows: list[Callable[..., Any] | None] = field(default_factory=list)
    shares: dict[int, float] = field(default_factory=dict)

    def rows_on(self) -> list[int]:
        return [r for r, fn in enumerate(self.by_rows) if fn is not None]


@dataclass(slots=True)
class _AttentionRoute:
    """The attention shape the model runs (query heads, key/value heads, head dim, dtype) and,
    per key-length bucket, what each query count runs."""

    shape: tuple[int, int, int, mx.Dtype]
    # per key bucket, the attention for each query count (index r; None: the stock path)
    by_rows: dict[int, list[Callable[..., Any] | None]] = field(default_factory=dict)
    open_ended: bool = False  # invariant: contexts past the last bucket take its verdicts too


class _Router:
    """Decides each routed matmul's and attention's path; kept lean (it runs ~200 times per
    forward)."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.recording: dict[int, mx.Dtype] | None = None
        self.routes: dict[int, _Route] = {}  # by id(module)
        self.calls = 0  # matmuls that took a kernel (for reports and tests)
        self.attention: _AttentionRoute | None = None
        self.attention_seen: set[tuple[int, int, int, mx.Dtype]] = set()  # while recording
        self.attention_calls = 0

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: Any, scale: float, mask: Any,
               sinks: Any) -> mx.array | None:  # fmt: skip
        if self.recording is not None:
            self.attention_seen.add((q.shape[1], k.shape[1], q.shape[3], q.dtype))
            return None
        route = self.attention
        if route is None or sinks is not None or hasattr(cache, "bits"):
            return None  # quantized caches and attention sinks keep the stock path
        if mask is not None and not isinstance(mask, str):
            return None  # an explicit mask array (padding, windows): stock
        if q.shape[2] > 1 and mask != "causal":
            return None  # the routes compute causal attention (a verify's rows)
        if (q.shape[1], k.shape[1], q.shape[3], q.dtype) != route.shape or q.shape[0] != 1:
            return None
        rows, keys = q.shape[2], k.shape[2]
        if k.dtype != q.dtype or v.shape != k.shape or v.dtype != q.dtype or keys < rows:
            return None  # the kernel's contract (a KV cache always meets it)
        from dspark_flow.kernels.probe import KEY_BUCKETS, key_bucket

        bucket = key_bucket(keys)
        if bucket is None and route.open_ended:  # the kernel is correct at any length
            bucket = KEY_BUCKETS[-1]
        fns = route.by_rows.get(bucket) if bucket is not None else None
        fn = fns[rows] if fns is not None and rows < len(fns) else None
        if fn is None:
            return None
        self.attention_calls += 1
        return fn(q, k, v, scale, mask)

    def matmul(self, module: nn.Module, x: mx.array) -> mx.array | None:
        if self.recording is not None:
            self.recording[id(module)] = x.dtype
            return None
        route = self.routes.get(id(module))
        if route is None or x.dtype != route.dtype:
            return None
        rows = x.size // x.shape[-1]
        if rows <= self.max_rows:
            fn = route.by_rows[rows] if rows < len(route.by_rows) else None
            if fn is None:
                return None
            self.calls += 1
            w, s, b = _quant_args(module)
            return fn(x, w, s, b, getattr(module, "group_size", 0), getattr(module, "bits", 0))
        share = route.shares.get(row_bucket(rows) or 0) if route.shares else None
        if share is None:
            return None
        self.calls += 1
        w, s, b = _quant_args(module)
        assert s is not None, "co-prefill routes quantized layers only"
        return coprefill_qmm(x, w, s, b, module.group_size, module.bits, share)


def _per_token(costs: list[float | None]) -> float:
    """A route's cost per token: its time for r rows divided by r, summed over r = 1, 2, ...;
    infinite where a timing is missing (nothing was timed)."""
    timed = [c for c in costs if c is not None]
    if len(timed) < len(costs):
        return float("inf")
    return float(sum(c / r for r, c in enumerate(timed, start=1)))


def _routed_linear_call(self: nn.Module, x: mx.array) -> mx.array:
    router = _ROUTER.get()
    y = router.matmul(self, x) if router is not None else None
    if y is None:
        return super(type(self), self).__call__(x)  # type: ignore[misc]  # set on a subclass
    return y + self["bias"] if "bias" in self else y


def _routed_as_linear(self: nn.Module, x: mx.array) -> mx.array:
    router = _ROUTER.get()
    y = router.matmul(self, x) if router is not None else None
    if y is None:
        return super(type(self), self).as_linear(x)  # type: ignore[misc]  # set on a subclass
    return y


def _probe_bar(total: int, gpu: bool) -> Any:
    """A progress bar over the probes: the first warm-up on a GPU measures for a minute or more
    (cached verdicts make later ones instant). Disabled on a CPU, where every probe declines
    at once; tqdm hides it where stderr is not a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="probing kernels", unit="shape", leave=False,
                disable=None if gpu else True)  # fmt: skip


def _routed_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        method = (
            "as_linear" if issubclass(cls, (nn.Embedding, nn.QuantizedEmbedding)) else "__call__"
        )
        impl = _routed_as_linear if method == "as_linear" else _routed_linear_call
        _SUBCLASSES[cls] = type(f"Routed{cls.__name__}", (cls,), {method: impl})
    return _SUBCLASSES[cls]


class KernelVerifier(Verifier):
    Config = KernelsConfig
    config: KernelsConfig

    def __init__(
        self,
        config: KernelsConfig | None = None,
        kernel: Callable[..., Any] | None = None,
        attention_kernel: Callable[..., Any] | None = None,
        rows_kernel: Callable[..., Any] | None = None,
        vector_rows_kernel: Callable[..., Any] | None = None,
    ):
        """`kernel`, `attention_kernel`, `rows_kernel` and `vector_rows_kernel` replace
        `qmm_small_m`, `sdpa_small_q`, `qmv_rows` and `sdpa_vector_rows` (tests inject fakes;
        the probes still judge them)."""
        super().__init__(config)
        self._kernel = kernel
        self._attention_kernel = attention_kernel
        self._rows_kernel = rows_kernel
        self._vector_rows_kernel = vector_rows_kernel
        self._router: _Router | None = None
        self._swapped: list[tuple[nn.Module, type]] = []
        # (id of the model, rows probed) warmed for: pipelines may share us, and one with a
        # longer drafter needs more rows probed
        self._warmed: tuple[int, int] | None = None
        self._max_rows = MAX_ROWS
        self._take_correct = False  # invariant mode in force (see _invariant)
        self._progress: Any = None  # the probes' progress bar while warming up
        self._not_invariant: list[str] = []  # why a layer shape has no invariant route
        self.verdicts: list[dict[str, Any]] = []  # one per probed shape, for reports
        self.compiled: CompiledLayers | None = None  # config.compile_layers, after warm-up
        self.fused: FusedProjections | None = None  # config.fuse_projections, after warm-up

    # -- routing ---------------------------------------------------------------------------

    def _layers(self, model: nn.Module) -> list[nn.Module]:
        """The matmuls to route: the model's quantized layers (on the CPU in invariant mode its
        dense ones too); with fused projections, the stacks in place of their parts (verify
        forwards call only the stacks)."""
        stacks = self._stacks()
        # Prefills past max_rows run the stock forward, which calls the parts: with co-prefill
        # they keep their routes (its shares), else verify forwards never call them.
        stacked = set() if self.config.coprefill else {id(p) for _, ps in stacks for p in ps}
        layers = []
        for module in [m for _, m in model.named_modules() if id(m) not in stacked] + [
            s for s, _ in stacks
        ]:
            if self._cpu_invariant() and _dense(module, self.config.head):
                if "bias" in module:  # nn.Linear adds it inside its matmul (addmm): not probed
                    self._not_invariant.append(
                        f"a dense layer with a bias: {type(module).__name__}"
                    )
                else:
                    layers.append(module)  # MLX's own matmul, chunked past its span
                continue
            if getattr(module, "mode", "affine") != "affine" or module.get("biases") is None:
                continue  # the kernels implement affine quantization only
            if isinstance(module, nn.QuantizedLinear) or (
                self.config.head and isinstance(module, nn.QuantizedEmbedding)
            ):
                layers.append(module)
        return layers

    def _stacks(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        """The fused projections' (stack, parts), none without `fuse_projections`."""
        return self.fused.stacks if self.fused is not None else []

    def _cpu_invariant(self) -> bool:
        """Invariant mode on the CPU: no kernel runs there, and MLX's own dense matmul and
        attention compute only a few rows alike (docs/kernels.md), so both are chunked."""
        return self._take_correct and mx.default_device() == mx.cpu

    def _swap(self, layers: list[nn.Module]) -> None:
        for module in layers:
            if type(module) not in _SUBCLASSES.values():
                self._swapped.append((module, type(module)))
                module.__class__ = _routed_class(type(module))

    def restore(self) -> None:
        """Give the swapped layers their own classes back and unwrap the attention."""
        if self.compiled is not None:
            self.compiled.restore()
            self.compiled = None
        self.fused = None  # the model's layers keep the views: the same values
        for module, cls in self._swapped:
            module.__class__ = cls
        self._swapped.clear()
        unwrap_attention(id(self))
        self._router, self._warmed = None, None  # a later warm_up routes afresh

    # -- warm-up ---------------------------------------------------------------------------

    def warm_up(self, ctx: BuildContext) -> None:
        rows = self._rows_wanted(ctx)
        if (
            self._warmed is not None
            and self._warmed[0] == id(ctx.model)
            and self._warmed[1] >= rows
        ):
            return
        self.restore()
        self._router, self._warmed, self.verdicts = None, None, []
        self._max_rows = rows
        try:
            if self.config.fusing:  # before routing: the stacked shapes get probed
                self.fused = FusedProjections.install(ctx.model)
            self._warm_up(ctx)
            self._compile_layers(ctx.model)
            # After the layers are compiled: their traces are what decoding will replay.
            # A CPU has no kernels to compile at first use (its routes are MLX's own ops in
            # chunks; the compiled layers trace as decoding meets each row count): only kernels,
            # a GPU's or ones a caller injected, are precompiled.
            gpu = mx.default_device() != mx.cpu
            kernels = self._router is not None and (gpu or self._kernel is not None)
            gpu_traces = self.compiled is not None and gpu
            if self.config.precompile and (kernels or gpu_traces):
                self._compile_row_counts(ctx.model)
        except BaseException:  # leave nothing half-routed; a later warm_up starts afresh
            if self._progress is not None:
                self._progress.close()
                self._progress = None
            self.restore()
            self._router = None
            raise
        self._warmed = (id(ctx.model), rows)

    def _compile_layers(self, model: nn.Module) -> None:
        """Compile the layers once the routes are settled (a trace bakes them in)."""
        if self.config.compile_layers:
            self.compiled = CompiledLayers(self._max_rows, self.fused)
            self.compiled.install(model)

    @property
    def exact_rows(self) -> int | None:
        """In invariant mode, once routes are set, the rows they were probed for (16, or the
        recipe's `max_rows`): a 17-row verify would run MLX's own layers, which round
        differently. (A shape left on the stock path keeps this bound; it is then a limit, not
        a promise.)"""
        return self._max_rows if self._take_correct and self._router is not None else None

    def _rows_wanted(self, ctx: BuildContext) -> int:
        """The largest verify forward to probe and route: the recipe's `max_rows`; in invariant
        mode all 16, since every pipeline on the target (plain greedy too) and every short
        prefill must route alike; else what the pipeline's drafter can ask for (probing 16 rows
        for a block-7 drafter doubles a first GPU warm-up for shapes decoding never runs)."""
        if self.config.max_rows is not None:
            return self.config.max_rows
        if self.config.invariant:
            return MAX_ROWS
        longest = ctx.drafter.max_draft if ctx.drafter is not None else None
        return MAX_ROWS if longest is None else max(1, min(MAX_ROWS, longest + 1))

    def _invariant(self) -> bool:
        """Invariant mode where it can hold: a backend with the attention kernel, or the CPU
        (MLX's own attention in chunks of its span); Metal has no attention kernel and its
        chunked attention is not measured here, so it stays off there. It stays on without a drafter:
        plain greedy through this verifier must compute what speculation through it does."""
        from dspark_flow.kernels import sdpa_small_q as a

        if not self.config.invariant:
            return False
        if self.config.attention and a.kernel_backend() is None and self._attention_kernel is None:
            if mx.default_device() == mx.cpu:  # MLX's own attention, in chunks of its span
                return True
            log.info("kernels verifier: no attention kernel on this backend: invariant mode off")
            return False
        return True

    def _warm_up(self, ctx: BuildContext) -> None:
        from dspark_flow.kernels import qmm_small_m as q
        from dspark_flow.kernels.probe import VerdictCache

        cfg = self.config
        self._take_correct = self._invariant()
        self._not_invariant.clear()
        layers = self._layers(ctx.model) if cfg.matmuls else []
        attended = attention_modules(ctx.model) if cfg.attention else []
        if not layers and not attended:
            log.info("kernels verifier: no affine-quantized layers and no attention to route")
            return
        router = _Router(self._max_rows)
        stacked = [p for _, parts in self._stacks() for p in parts]
        self._swap(layers + stacked)  # the parts too: the recording forward below calls them
        if attended:
            wrap_attention(ctx.model, id(self))
        router.recording = {}
        token = _ROUTER.set(router)
        try:  # one token, no cache: learns each layer's activation dtype, the attention shape
            with attention_hook(router.attend):
                mx.eval(ctx.model(mx.array([[1]], dtype=mx.uint32)))
        finally:
            _ROUTER.reset(token)
        seen, router.recording = router.recording, None
        for stack, parts in self._stacks():
            if id(parts[0]) in seen:  # the stock forward calls the parts, decoding the stack
                seen[id(stack)] = seen[id(parts[0])]
        store = VerdictCache()
        shapes: dict[tuple[Any, ...], list[nn.Module]] = {}
        for module in layers:
            if id(module) in seen:  # a layer the forward never calls is left alone
                w, s, _ = _quant_args(module)
                bits, gs = getattr(module, "bits", 0), getattr(module, "group_size", 0)
                # dense (bits 0, the CPU's invariant routes): the weights' dtype in the scales' place
                wdt = w.dtype if s is None else s.dtype
                shape = (w.shape[0], _in_features(module), bits, gs, seen[id(module)], wdt)
                shapes.setdefault(shape, []).append(module)
        # Every kernel needs a GPU backend qmm_small_m knows (sdpa_small_q: CUDA, a subset).
        gpu = q.kernel_backend() is not None
        self._progress = _probe_bar(self._probe_count(shapes, router), gpu=gpu)
        for (n, k, bits, gs, x_dtype, s_dtype), group in shapes.items():
            by_rows = self._matmul_routes((n, k, bits, gs, x_dtype, s_dtype), store)
            if any(fn is not None for fn in by_rows):
                for m in group:
                    router.routes.setdefault(id(m), _Route(x_dtype)).by_rows = by_rows
            if cfg.coprefill:
                self._probe_coprefill(router, group, n, k, bits, gs, x_dtype, s_dtype, store)
        if len(router.attention_seen) == 1:  # one attention shape: every layer alike
            router.attention = self._probe_attention(next(iter(router.attention_seen)), store)
        elif self._take_correct and (router.attention_seen or not cfg.attention):
            self._not_invariant.append("the attention is not routed (attention off, or several "
                                       "attention shapes)")  # fmt: skip
        self._progress.close()
        self._progress = None
        if router.attention is None:
            unwrap_attention(id(self))
        wrong = self._not_invariant
        if self._take_correct and wrong:
            log.warning("kernels verifier: not invariant, some shapes keep the stock path",
                        shapes=len(wrong), reason=wrong[0])  # fmt: skip
        # Only routed layers keep the routed class; the rest get their own back.
        keep = [(m, c) for m, c in self._swapped if id(m) in router.routes]
        for module, cls in self._swapped:
            if id(module) not in router.routes:
                module.__class__ = cls
        self._swapped = keep
        if router.routes or router.attention is not None:
            self._router = router
            rows_on = sorted({r for rt in router.routes.values() for r in rt.rows_on()})
            attention_on = {
                bucket: [r for r, fn in enumerate(fns) if fn is not None]
                for bucket, fns in (router.attention.by_rows if router.attention else {}).items()
            }  # fmt: skip
            log.info("kernels verifier: kernels enabled", layers=len(keep), rows=rows_on,
                     attention_queries_by_keys=attention_on)  # fmt: skip
        else:
            why = self.verdicts[0]["reason"] if self.verdicts else "no shapes"
            log.info("kernels verifier: every probe declined", reason=why)

    def _matmul_routes(self, shape: tuple[Any, ...], store: Any) -> list[Callable[..., Any] | None]:
        """Probe rows 1..max_rows of one layer shape; the matmul for each row count (index r;
        None: the stock path). Outside invariant mode the kernel where it is faster; in
        invariant mode one route, among those that compute every row alike
        (`_invariant_routes`)."""
        from dspark_flow.kernels import qmm_small_m as q
        from dspark_flow.kernels.probe import dtype_name, probe_qmm

        n, k, bits, gs, x_dtype, s_dtype = shape
        if bits == 0:
            return self._dense_routes(shape, store)
        kernel = self._kernel or q.qmm_small_m_trusted
        verdicts = []
        for rows in range(1, self._max_rows + 1):
            v = probe_qmm(
                rows, n, k, bits, gs, x_dtype, s_dtype, self._kernel, self.config.min_gain,
                store, self.config.reprobe,
            )  # fmt: skip
            self._note("qmm_small_m", v, rows=rows, n=n, k=k, bits=bits, group_size=gs,
                       dtype=dtype_name(x_dtype))  # fmt: skip
            verdicts.append(v)
        if not self._take_correct:
            return [None] + [kernel if v.enabled else None for v in verdicts]
        return self._invariant_routes(shape, kernel, verdicts, store)

    def _dense_routes(self, shape: tuple[Any, ...], store: Any) -> list[Callable[..., Any] | None]:
        """A dense layer's invariant route on the CPU: MLX's own matmul for rows 1..span, which
        it computes as it computes one row (measured: `probe_dense_span`), in chunks of the span
        past it (None everywhere: the span covers every row count, nothing to reroute); with
        `pad_rows`, a span under PAD_BELOW_SPAN and products that agree from PAD_FLOOR rows on
        (`probe_dense_floor`), one row padded to PAD_FLOOR and MLX's own matmul for the rest."""
        from dspark_flow.kernels import stock_rows
        from dspark_flow.kernels.probe import dtype_name, probe_dense_floor, probe_dense_span

        n, k, _, _, x_dtype, w_dtype = shape
        top = self._max_rows
        v = probe_dense_span(top, n, k, x_dtype, store, self.config.reprobe, w_dtype)
        self._note("dense_row_span", v, rows=top, n=n, k=k, dtype=dtype_name(x_dtype),
                   weights=dtype_name(w_dtype))  # fmt: skip
        span = min(int(v.extra.get("span", 0)), top)
        if span == 0:
            self._not_invariant.append(f"no invariant dense matmul for {n}x{k}: {v.reason}")
            return [None] * (top + 1)
        if self.config.pad_rows and span < min(PAD_BELOW_SPAN, top):
            fv = probe_dense_floor(top, n, k, x_dtype, store, self.config.reprobe, w_dtype)
            self._note("dense_row_floor", fv, rows=top, n=n, k=k, dtype=dtype_name(x_dtype),
                       weights=dtype_name(w_dtype))  # fmt: skip
            floor = int(fv.extra.get("floor", 0))
            if 0 < floor <= PAD_FLOOR:
                pad = stock_rows.dense_padded(floor)
                return [None] + [pad] * (floor - 1) + [None] * (top - floor + 1)
        return _stock_then(span, stock_rows.dense_chunked(span), top)

    def _chunked_attention(
        self, shape: tuple[int, int, int, mx.Dtype], store: Any
    ) -> _AttentionRoute | None:
        """The attention's invariant route where no attention kernel runs (the CPU): per key
        bucket MLX's own attention for the query counts it computes as one (its probed span),
        in chunks of that span past them."""
        from dspark_flow.kernels import stock_rows
        from dspark_flow.kernels.probe import KEY_BUCKETS

        top = self._max_rows
        route = _AttentionRoute(shape, open_ended=True)
        for bucket in KEY_BUCKETS:
            sp, span = self._attention_span(shape, bucket, store)
            if span == 0:
                self._not_invariant.append(f"no invariant attention: {sp.reason}")
                return None
            route.by_rows[bucket] = _stock_then(span, stock_rows.attention_chunked(span), top)
        return route

    def _attention_span(
        self, shape: tuple[int, int, int, mx.Dtype], bucket: int, store: Any
    ) -> tuple[Any, int]:
        """(verdict, span): how many query rows (at most max_rows) MLX's own attention computes
        as it computes one, in this key bucket (`probe_sdpa_stock_span`, noted)."""
        from dspark_flow.kernels.probe import dtype_name, probe_sdpa_stock_span

        hq, hkv, d, dtype = shape
        top = self._max_rows
        sp = probe_sdpa_stock_span(top, bucket, hq, hkv, d, dtype, store, self.config.reprobe)
        self._note("sdpa_stock_span", sp, rows=top, keys=bucket, q_heads=hq, kv_heads=hkv,
                   head_dim=d, dtype=dtype_name(dtype))  # fmt: skip
        return sp, min(int(sp.extra.get("span", 0)), top)

    def _invariant_routes(
        self, shape: tuple[Any, ...], kernel: Callable[..., Any], verdicts: list[Any], store: Any
    ) -> list[Callable[..., Any] | None]:
        """A route that computes every row alike, judged by its probe timings per token (a
        forward of r rows timed at t ms counts t / r, summed over r = 1..max_rows):
        (a) the kernel for every row count, where it is correct for all of them;
        (b) MLX's own matmul for rows 1..span, which it computes as it computes one row
            (measured: `probe_stock_span`), and past the span either `qmv_rows`, where it
            reproduced MLX's one-row results bit for bit, or MLX's matmul in chunks of `span`
            rows.
        The cheapest wins (on a tie the one with less custom code); with `prefer_stock`, the
        cheapest (b) unless (a) is cheaper by more than `PREFER_STOCK_LIMIT` (`_choose`)."""
        from dspark_flow.kernels.probe import dtype_name, probe_stock_span

        n, k, bits, gs, x_dtype, s_dtype = shape
        top = self._max_rows
        where = {"n": n, "k": k, "bits": bits, "group_size": gs, "dtype": dtype_name(x_dtype)}
        sv = probe_stock_span(top, n, k, bits, gs, x_dtype, s_dtype, store, self.config.reprobe)
        self._note("stock_row_span", sv, rows=top, **where)
        span = min(int(sv.extra.get("span", 0)), top)
        candidates: list[tuple[float, list[Callable[..., Any] | None]]] = []  # route (b)
        kernel_route = None  # route (a)
        if span:
            stock = [v.twin_ms for v in verdicts[:span]]
            if span == top:
                candidates.append((_per_token(stock), [None] * (top + 1)))
            for fn, costs in self._past_span(shape, span, where, store):
                candidates.append((_per_token(stock + costs), _stock_then(span, fn, top)))
        if all(v.correct for v in verdicts):
            kernel_route = (_per_token([v.kernel_ms for v in verdicts]), [None] + [kernel] * top)
        chosen = self._choose(candidates, kernel_route)
        if chosen is not None:
            return chosen
        self._not_invariant.append(f"no invariant matmul for {where}: {sv.reason}")
        return [None] * (top + 1)  # one path for every row count at least: the stock one

    def _past_span(
        self, shape: tuple[Any, ...], span: int, where: dict[str, Any], store: Any
    ) -> list[tuple[Callable[..., Any], list[float | None]]]:
        """What can run rows span+1..max_rows exactly as MLX runs one row, with its timings:
        MLX's matmul in chunks of `span` rows, and `qmv_rows` in the first dequantization
        variant that is bitwise exact for all of them."""
        from dspark_flow.kernels import qmv_rows, stock_rows
        from dspark_flow.kernels.probe import probe_qmm_chunks, probe_qmv_rows

        n, k, bits, gs, x_dtype, s_dtype = shape
        rows = range(span + 1, self._max_rows + 1)
        cfg = self.config
        found: list[tuple[Callable[..., Any], list[float | None]]] = []
        self._more_probes(len(rows))
        chunks = []
        for r in rows:
            c = probe_qmm_chunks(r, n, k, bits, gs, x_dtype, s_dtype, span, cfg.min_gain, store,
                                 cfg.reprobe)  # fmt: skip
            self._note(stock_rows.NAME, c, **{**where, "rows": r})
            chunks.append(c)
        if all(c.correct for c in chunks):
            found.append((stock_rows.chunked(span), [c.kernel_ms for c in chunks]))
        for fused in qmv_rows.VARIANTS:
            self._more_probes(len(rows))
            verdicts = []
            for r in rows:
                v = probe_qmv_rows(r, n, k, bits, gs, x_dtype, s_dtype, fused, self._rows_kernel,
                                   cfg.min_gain, store, cfg.reprobe)  # fmt: skip
                self._note(qmv_rows.KERNEL_NAME, v, **{**where, "rows": r, "fused": fused})
                verdicts.append(v)
                if not v.extra.get("bitwise"):  # rounds differently: the other rows need no probe
                    self._more_probes(len(verdicts) - len(rows))
                    break
            if len(verdicts) == len(rows) and all(v.extra.get("bitwise") for v in verdicts):
                fn = self._rows_kernel or qmv_rows.variant(fused)
                found.append((fn, [v.kernel_ms for v in verdicts]))
                break
        return found

    def _more_probes(self, count: int) -> None:
        """Grow (or shrink) the progress bar's total by probes that the probes before them
        decided to run (or skip)."""
        if self._progress is not None:
            self._progress.total += count
            self._progress.refresh()

    def _probe_attention(
        self, shape: tuple[int, int, int, mx.Dtype], store: Any
    ) -> _AttentionRoute | None:
        """Probe the attention for 1..max_rows queries in every key-length bucket. Outside
        invariant mode `sdpa_small_q` takes the query counts where it is faster; in invariant
        mode one route for every bucket (a verify's rows may straddle two), the cheaper per token
        of (a) `sdpa_small_q` for every query count, where it is correct for all, and (b) MLX's
        own attention for the query counts it computes as one (its probed span, at least one)
        and `sdpa_vector_rows` past them, where it reproduced MLX's one-row results bit for bit
        in every bucket; chosen as the matmuls' routes are (`_choose`)."""
        from dspark_flow.kernels import sdpa_small_q as a
        from dspark_flow.kernels.probe import KEY_BUCKETS, dtype_name, probe_sdpa

        if self._cpu_invariant() and self._attention_kernel is None:
            return self._chunked_attention(shape, store)
        hq, hkv, d, dtype = shape
        top = self._max_rows
        kernel = self._attention_kernel or a.sdpa_small_q_trusted
        route = _AttentionRoute(shape)
        verdicts: dict[int, list[Any]] = {}
        for bucket in KEY_BUCKETS:
            for rows in range(1, top + 1):
                v = probe_sdpa(
                    rows, bucket, hq, hkv, d, dtype, self._attention_kernel, self.config.min_gain,
                    store, self.config.reprobe,
                )  # fmt: skip
                self._note("sdpa_small_q", v, rows=rows, keys=bucket, q_heads=hq, kv_heads=hkv,
                           head_dim=d, dtype=dtype_name(dtype))  # fmt: skip
                verdicts.setdefault(bucket, []).append(v)
        if not self._take_correct:
            for bucket, vs in verdicts.items():
                if any(v.enabled for v in vs):
                    first: list[Callable[..., Any] | None] = [None]  # no kernel for 0 rows
                    route.by_rows[bucket] = first + [kernel if v.enabled else None for v in vs]
            return route if route.by_rows else None
        route.open_ended = True
        rows_route = self._vector_rows_route(shape, verdicts, store)
        kernel_route = None
        if all(v.correct for vs in verdicts.values() for v in vs):
            cost = sum(_per_token([v.kernel_ms for v in vs]) for vs in verdicts.values())
            kernel_route = (cost, {b: [None] + [kernel] * top for b in verdicts})
        chosen = self._choose([rows_route] if rows_route else [], kernel_route)
        if chosen is None:
            self._not_invariant.append("no invariant attention: " + next(
                v.reason for vs in verdicts.values() for v in vs if not v.correct))  # fmt: skip
            return None
        route.by_rows = chosen
        return route

    def _choose(self, stock: list[tuple[float, Any]], kernel: tuple[float, Any] | None) -> Any:
        """Between invariant routes with their probe costs per token: (b) `stock`, MLX's own
        kernels and their bitwise twins (several ways past the span), and (a) `kernel`, ours for
        every row count. Without `prefer_stock` the cheapest (the first of equals: less custom
        code); with it the cheapest (b), unless (a) is cheaper by more than PREFER_STOCK_LIMIT
        (a probe times a kernel alone, not the host time its calls add to a forward, so it
        flatters ours; but a (b) of many chunks can cost several times more). None: no route."""
        best = min(stock, key=lambda c: c[0]) if stock else None
        if (
            self.config.prefer_stock
            and best is not None
            and (kernel is None or best[0] <= PREFER_STOCK_LIMIT * kernel[0])
        ):
            return best[1]
        options = [*stock, *([kernel] if kernel is not None else [])]
        return min(options, key=lambda c: c[0])[1] if options else None

    def _vector_rows_route(
        self, shape: tuple[int, int, int, mx.Dtype], verdicts: dict[int, list[Any]], store: Any
    ) -> tuple[float, dict[int, list[Callable[..., Any] | None]]] | None:
        """Route (b) of `_probe_attention` with its cost per token, or None where
        `sdpa_vector_rows` is not bitwise exact for every query count it would run: per bucket
        MLX's own attention for the query counts it computes as one row (`stock_span`, measured
        and cached; at least one query), `sdpa_vector_rows` past them."""
        from dspark_flow.kernels import sdpa_vector_rows as sv
        from dspark_flow.kernels.probe import dtype_name, probe_sdpa_rows

        hq, hkv, d, dtype = shape
        top = self._max_rows
        fn = self._vector_rows_kernel or sv.sdpa_vector_rows_trusted
        cost = 0.0
        by_rows: dict[int, list[Callable[..., Any] | None]] = {}
        for bucket, vs in verdicts.items():
            self._more_probes(1)
            span = max(1, self._attention_span(shape, bucket, store)[1])
            costs = [v.twin_ms for v in vs[:span]]  # MLX's own attention, timed by probe_sdpa
            by_rows[bucket] = _stock_then(span, fn, top)
            self._more_probes(top - span)
            for rows in range(span + 1, top + 1):
                v = probe_sdpa_rows(rows, bucket, hq, hkv, d, dtype, self._vector_rows_kernel,
                                    self.config.min_gain, store, self.config.reprobe)  # fmt: skip
                self._note(sv.KERNEL_NAME, v, rows=rows, keys=bucket, q_heads=hq, kv_heads=hkv,
                           head_dim=d, dtype=dtype_name(dtype))  # fmt: skip
                if not v.extra.get("bitwise"):
                    self._more_probes(rows - top)  # the rest of this bucket need not run
                    return None
                costs.append(v.kernel_ms)
            cost += _per_token(costs)
        return cost, by_rows

    def _probe_coprefill(self, router, group, n, k, bits, gs, x_dtype, s_dtype, store) -> None:
        from dspark_flow.kernels.coprefill import ROW_BUCKETS, probe_coprefill
        from dspark_flow.kernels.probe import dtype_name

        for rows in ROW_BUCKETS:
            v = probe_coprefill(
                rows, n, k, bits, gs, x_dtype, s_dtype, self.config.min_gain, store,
                self.config.reprobe,
            )  # fmt: skip
            self._note("coprefill_qmm", v, rows=rows, n=n, k=k, bits=bits, group_size=gs,
                       dtype=dtype_name(x_dtype))  # fmt: skip
            if v.enabled:
                for m in group:
                    route = router.routes.setdefault(id(m), _Route(x_dtype))
                    route.shares[rows] = float(v.extra["share"])

    def _probe_count(self, shapes: dict[Any, Any], router: _Router) -> int:
        from dspark_flow.kernels.coprefill import ROW_BUCKETS
        from dspark_flow.kernels.probe import KEY_BUCKETS

        per_shape = self._max_rows + (len(ROW_BUCKETS) if self.config.coprefill else 0)
        if self._take_correct:  # the stock matmul's span (what runs past it: `_more_probes`)
            per_shape += 1
        attention_probes = (
            len(KEY_BUCKETS) * self._max_rows if len(router.attention_seen) == 1 else 0
        )
        return len(shapes) * per_shape + attention_probes

    def _note(self, kernel: str, v: Any, **shape: Any) -> None:
        self.verdicts.append({"kernel": kernel, **shape, **v.to_json(), "cached": v.cached})
        if self._progress is not None:
            self._progress.update(1)

    def matmul_routes(self) -> dict[str, list[str]]:
        """Per routed layer shape ("NxK b<bits>"), what each row count 1..max_rows runs: "stock"
        or the name of the kernel (or chunked stock matmul) that replaces it."""
        from dspark_flow.kernels.probe import dtype_name

        routes: dict[str, list[str]] = {}
        for module, _ in self._swapped if self._router is not None else []:
            route = self._router.routes.get(id(module))  # type: ignore[union-attr]
            if route is not None:
                w, bits = module["weight"], getattr(module, "bits", 0)
                kind = f"b{bits}" if bits else dtype_name(w.dtype)
                shape = f"{w.shape[0]}x{_in_features(module)} {kind}"
                names = [getattr(fn, "__name__", "kernel") if fn else "stock"
                         for fn in route.by_rows[1:]]  # fmt: skip
                routes[shape] = names + ["stock"] * (self._max_rows - len(names))
        return routes

    @property
    def kernel_calls(self) -> int:
        """Matmuls that went through a kernel so far."""
        return self._router.calls if self._router is not None else 0

    @property
    def attention_calls(self) -> int:
        """Attention calls that went through the kernel so far."""
        return self._router.attention_calls if self._router is not None else 0

    def _compile_row_counts(self, model: nn.Module) -> None:
        """One forward of each row count 1..max_rows on a throwaway cache. On MLX's CUDA
        backend the first use of a verify shape compiles kernels (the kernels' row buckets,
        MLX's own ops, the compiled layers' fused kernels): measured there as first runs up to
        56x slower than later ones (benchmarks §3), a cost the first requests would otherwise
        pay. The probes' cached verdicts skip the compiling probe runs, so nothing else warms
        these shapes. Not run on a CPU (unless kernels were injected): nothing there compiles
        kernels at first use, and the compiled layers trace as decoding meets each row count."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for rows in range(1, self._max_rows + 1):
            mx.eval(self.forward(model, [1] * rows, cache))
        if self._router is not None:  # the counters report decoding, not this
            self._router.calls = self._router.attention_calls = 0
        log.info("kernels verifier: verify shapes compiled", rows=self._max_rows,
                 seconds=round(time.perf_counter() - t0, 2))  # fmt: skip

    # -- forward ---------------------------------------------------------------------------

    def forward(self, model: nn.Module, tokens: list[int] | mx.array, cache: list[Any]) -> mx.array:
        ids = mx.array(tokens, dtype=mx.uint32)[None]
        with compiled_scope(self.compiled):
            if self._router is None:
                return model(ids, cache=cache)[0]
            token = _ROUTER.set(self._router)
            try:  # the graph is built here; evaluation later needs no router
                with attention_hook(self._router.attend):
                    return model(ids, cache=cache)[0]
            finally:
                _ROUTER.reset(token)
