"""Every Python snippet of the README and the documentation pages runs as written.

A page's snippets run in order in one namespace (a later snippet may use what an earlier one
made), on a fresh tiny checkpoint with a real byte-level chat tokenizer. The names the pages use
without defining them (``model``, ``tokenizer``, ``inputs``, ``document_ids``, ...) are built
here; ``kvpatch.tools.demo.load`` returns the tiny checkpoint. The one rewrite: ``cache=cache``
becomes ``past_key_values=cache`` on a transformers older than 5.24, as the snippets' comments say.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvpatch import compat
from kvpatch.tools import demo
from kvpatch.tools.testing import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

DOCUMENT = (
    "Lease agreement. The tenant is Ada Moreau and the landlord is Piet Olsen. The rent is 1,200 "
    "euros a month, due on the first day. The lease starts on 1 March and is signed in Ghent. "
)


def snippets(page: Path) -> list[str]:
    return SNIPPET.findall(page.read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-docs")))


def the_pages_names(checkpoint: str) -> dict:
    """What the pages take as given, built on the tiny checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # as a causal LM's declares

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt").input_ids

    def turn(text: str) -> torch.Tensor:  # 1-D, as generate_many and extend take them
        return ids(text)[0]

    return {
        "torch": torch,
        "model": model,
        "tokenizer": tokenizer,
        "draft_model": AutoModelForCausalLM.from_pretrained(checkpoint),
        "inputs": tokenizer(DOCUMENT + "Who is the tenant?", return_tensors="pt"),
        "prompts": [DOCUMENT + "Who is the tenant?", "What is the rent?"],
        "document": DOCUMENT,
        "document_ids": ids(DOCUMENT * 3),
        "context_ids": ids(DOCUMENT * 3),
        "long_ids": ids(DOCUMENT * 12),  # > 2,000 tokens: chunks of 1,024
        "ids": ids(DOCUMENT),
        "next_user_ids": ids(" And the rent?"),
        "question_ids": ids(" Who is the tenant?"),
        "q1_ids": turn(" Who is the tenant?"),
        "q2_ids": turn(" What is the rent?"),
        "q3_ids": turn(" Where was it signed?"),
        "first_turn_ids": ids(DOCUMENT),
        "later_turns": [ids(" The deposit is two months of rent."), ids(" Pets are allowed.")],
    }


def as_installed(code: str, model) -> str:
    if compat.cache_argument(model) == "past_key_values":
        return code.replace("cache=cache", "past_key_values=cache")
    return code


def test_the_pages_have_snippets():
    """The parser finds them (a broken fence would silently leave a page untested)."""
    counted = {page.name: len(snippets(page)) for page in PAGES}
    assert counted["README.md"] >= 3 and counted["usage.md"] >= 4
    for page in PAGES:
        assert page.read_text().count("```python") == counted[page.name]


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)], ids=lambda p: p.name)
def test_every_snippet_of_a_page_runs(page, checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the snippets write (report.kvz) land here
    names = the_pages_names(checkpoint)
    monkeypatch.setattr(demo, "load", lambda *a, **k: (names["model"], names["tokenizer"]))
    for number, code in enumerate(snippets(page), 1):
        code = as_installed(code, names["model"])
        exec(compile(code, f"{page.name}, snippet {number}", "exec"), names)
