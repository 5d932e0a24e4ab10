"""The eval's choices, known without importing torch: ``kvpatch eval --help`` answers at once."""

from kvpatch.tools.loading import DTYPES

#: the tasks: single needle, multi-key (distractors), multi-value, multi-question (three
#: questions on one compressed context), multi-fact (the same with three kinds of fact), chat
#: (a history compressed turn by turn)
TASKS = ("single", "multikey", "multivalue", "multiquestion", "multifact", "chat")
#: ``chat``: the tokenizer's chat template; ``completion``: plain text, for base models
PROMPT_FORMATS = ("chat", "completion")
DEFAULT_POLICIES = ("snapkv", "ada-snapkv", "tova", "knorm", "streamingllm", "think:0.5+snapkv")
DEFAULT_RATIOS = (0.25, 0.5, 0.75, 0.9)
#: ``prefill``: the question is in the prefill; ``agnostic``: the context is compressed first
MODES = ("prefill", "agnostic")
#: the policy name of the uncompressed baseline every run has
FULL = "full"

__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_RATIOS",
    "DTYPES",
    "FULL",
    "MODES",
    "PROMPT_FORMATS",
    "TASKS",
]
