"""Every script in examples/ runs end to end (on a tiny checkpoint, or quickstart's own tiny
model), and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpatch.testing import save_tiny_checkpoint

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
    assert out.count("Q: ") == 3 and out.count("A: ") == 3
    held, full = (float(x.split()[0]) for x in out.split("document: ")[1].split(",")[:2])
    assert held < 0.3 * full  # global-kvzip:0.75


def test_chat_document(checkpoint):
    out = run("chat_document.py", "--model", checkpoint, "--max-new-tokens", "4")
    stats = [line for line in out.splitlines() if "KV cache:" in line]
    assert len(stats) == 3 and all("saved" in line for line in stats)


def test_long_generation(checkpoint):
    args = ["--model", checkpoint, "--tokens", "200", "--budget", "80", "--interval", "16"]
    out = run("long_generation.py", *args)
    assert "200 tokens generated" in out
    held = int(out.split(" held per head")[0].split()[-1])
    assert 80 <= held <= 80 + 16


def test_quickstart_on_its_tiny_model():
    out = run("quickstart.py", "--tiny", "--prompt-tokens", "300", "--new-tokens", "4")
    assert "KV" in out
