"""Training text a model writes itself, for fitting its hidden-state map without a data set: general
prose sampled from a few seed prompts (no planted facts, nothing built like the evaluation's
haystacks)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

#: what the model writes about when it makes its own training text
SEED_PROMPTS = (
    "Write a long, detailed story about a lighthouse keeper and a storm.",
    "Explain in detail how a city's water supply works, from the reservoir to the tap.",
    "Write a travel diary of a week spent walking across the mountains.",
    "Describe the history of printing, from woodblocks to modern presses.",
    "Write a long letter from a grandmother to her grandson about her childhood.",
    "Explain how a small bakery plans its day, its recipes and its customers.",
    "Write a detailed report on how bees build and run their hive.",
    "Tell the story of a chess tournament from the point of view of a young player.",
    "Describe a busy train station from dawn to midnight.",
    "Explain how ships navigated the oceans before satellites.",
    "Write the minutes of a long town council meeting about a new park.",
    "Describe the life of a river from its source in the hills to the sea.",
)


def _quiet(message: str) -> None:
    pass


def sample_texts(
    model,
    tokenizer,
    count: int = 12,
    tokens: int = 512,
    seed: int = 0,
    progress: Callable[[str], None] = _quiet,
) -> list[str]:
    """``count`` texts of up to ``tokens`` tokens the model writes from :data:`SEED_PROMPTS`
    (cycled), sampled in one batch with a fixed seed."""
    from transformers import StoppingCriteriaList

    prompts = [SEED_PROMPTS[i % len(SEED_PROMPTS)] for i in range(count)]
    templated = bool(getattr(tokenizer, "chat_template", None))
    if templated:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    else:
        prompts = [p + "\n\n" for p in prompts]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # flush right, to generate
    try:
        encoded = tokenizer(
            prompts, return_tensors="pt", padding=True, add_special_tokens=not templated
        )
    finally:
        tokenizer.padding_side = side
    device = next(model.parameters()).device
    # what a causal LM reads: a tokenizer's token_type_ids would be refused by generate
    encoded = {k: encoded[k].to(device) for k in ("input_ids", "attention_mask")}
    progress(f"writing {count} training texts of up to {tokens} tokens (sampled, seed {seed})")
    torch.manual_seed(seed)
    out = model.generate(
        **encoded,
        max_new_tokens=tokens,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        stopping_criteria=StoppingCriteriaList([_Written(tokens, progress)]),
    )
    new = out[:, encoded["input_ids"].shape[1] :]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


class _Written:
    """A stopping criterion that never stops: says every eighth of the way how many tokens
    each text has so far (writing them takes minutes on a CPU)."""

    def __init__(self, tokens: int, progress: Callable[[str], None]):
        self.tokens, self.progress = tokens, progress
        self.every, self.steps, self.start = max(1, tokens // 8), 0, time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        self.steps += 1
        if self.steps % self.every == 0 and self.steps < self.tokens:
            seconds = time.perf_counter() - self.start
            self.progress(f"  {self.steps}/{self.tokens} tokens of each text ({seconds:.0f} s)")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def documents(texts: list[str], per_document: int = 3) -> list[str]:
    """``texts`` joined ``per_document`` at a time into longer documents."""
    return ["\n\n".join(texts[i : i + per_document]) for i in range(0, len(texts), per_document)]
