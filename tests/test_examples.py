"""Every script in examples/ runs end to end (on a tiny checkpoint, or quickstart's own tiny
model), and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpatch.tools.testing import save_tiny_checkpoint

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-examples")))


def run(script: str, *args: str) -> str:
    command = [sys.executable, str(EXAMPLES / script), *args]
    result = subprocess.run(command, capture_output=True, text=True, errors="replace", check=True)
    return result.stdout


def test_every_example_is_run_here():
    tested = {"quickstart.py", "ask_many.py", "pipeline_questions.py", "chat_document.py"}
    tested |= {"long_generation.py"}  # ask_many.py needs the demo model: tests/test_real_model.py
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_pipeline_questions(checkpoint):
    out = run("pipeline_questions.py", "--model", checkpoint, "--max-new-tokens", "4")
    assert out.count("Q: ") == 3 and out.count("(expected: ") == 3
    assert out.count("(right)") + out.count("(wrong)") == 6  # the full cache and compressed
    held, full = (float(x.split()[0]) for x in out.split("document: ")[1].split(",")[:2])
    assert held < 0.3 * full  # global-kvzip:0.75


def test_chat_document(checkpoint):
    out = run("chat_document.py", "--model", checkpoint, "--max-new-tokens", "4")
    assert out.count("(expected: ") == 3
    assert out.count("(right)") + out.count("(wrong)") == 6  # the full cache and compressed
    stats = [line for line in out.splitlines() if "KV cache:" in line]
    assert len(stats) == 2 and "(0.0% saved)" in stats[0] and "(0.0% saved)" not in stats[1]


def test_long_generation(checkpoint):
    args = ["--model", checkpoint, "--tokens", "200", "--budget", "80", "--interval", "16"]
    out = run("long_generation.py", *args)
    assert "200 tokens generated" in out
    # the bytes held, printed as the tokens stream: constant once the budget is reached
    shown = re.findall(r"\[(\d+) tokens: (\d+) held per head, ([\d.]+) MiB\]", out)
    assert [int(n) for n, _, _ in shown] == list(range(16, 201, 16))
    assert all(80 <= int(held) <= 96 for n, held, _ in shown if int(n) >= 96)
    held = int(re.search(r"(\d+) held per head now", out).group(1))
    assert 80 <= held <= 80 + 16


def test_quickstart_on_its_tiny_model():
    """The sizes it prints are the cache's: the full one what 4 layers x 2 KV heads x 32
    channels of keys and values hold for the tokens seen, the compressed one at least the
    quarter of the prompt each head keeps at 0.75 (and the tokens decoded), at most its share
    plus the index and the tail's spare room; both answers are 4 token ids."""
    out = run("quickstart.py", "--tiny", "--prompt-tokens", "300", "--new-tokens", "4")
    per_token = 4 * 2 * 2 * 32 * 4  # layers, keys and values, KV heads, channels, fp32 bytes
    seen = 300 + 4 - 1  # the last new token is never written to the cache
    full = float(re.search(r"KV cache, full: +([\d.]+) MB", out).group(1))
    held = float(re.search(r"KV cache, compressed: +([\d.]+) MB", out).group(1))
    saved = float(re.search(r"memory saved: .*\(([\d.]+)%\)", out).group(1))
    assert full == round(per_token * seen / 2**20, 2)
    kept = 300 - int(300 * 0.75) + 3
    assert round(per_token * kept / 2**20, 2) <= held <= 0.4 * full
    assert abs(saved - 100 * (1 - held / full)) < 1.5  # from the unrounded bytes
    for answer in re.findall(r"answer \(token ids\): +(\[.*\])", out):
        assert len(answer.split(",")) == 4
