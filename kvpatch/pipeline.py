"""``pipeline("kvpatch-text-generation")``: compress a context once, answer many questions.

>>> import kvpatch                       # registers the task name with transformers
>>> ask = pipeline(
...     "kvpatch-text-generation", model=model, tokenizer=tokenizer, policy=kvpatch.DOCUMENT_POLICY
... )
>>> ask(context=document, questions=["Who?", "When?"], max_new_tokens=32)
[{'question': 'Who?', 'generated_text': '...', 'kv_bytes': ..., 'uncompressed_kv_bytes': ...,
  'ratio': 0.74}, ...]

The context goes into the chat template's user turn, before the question: everything up to the
question is prefilled and compressed once (:func:`kvpatch.prefill`), and the questions (each
with the template's end of turn and the assistant's prefix) are answered together, in one batch
that reads that cache in place (:meth:`~kvpatch.CompressedContext.generate_many`). A model
already enabled keeps its state; one that is not is enabled for the call and disabled after.

``context=`` also takes a context compressed earlier: a :class:`~kvpatch.CompressedContext` of
this model, e.g. one :func:`kvpatch.load_context` read from a file that ``kvpatch compress``
wrote (its text went through :func:`context_text` as here).
"""

from __future__ import annotations

import contextlib

from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from kvpatch.chat import bos_text, split_turn
from kvpatch.context import CompressedContext, prefill
from kvpatch.patching import enabled, is_enabled
from kvpatch.policies import DEFAULT_POLICY, parse_policy

TASK = "kvpatch-text-generation"


class CompressedQAPipeline(Pipeline):
    """Answers ``questions`` about one ``context`` from a single compressed prefill.

    Parameters (given to ``pipeline(...)`` or to each call)
    ----------
    policy : str or Policy
        What to keep of the context (e.g. :data:`kvpatch.DOCUMENT_POLICY`); by default the enabled
        model's own policy, else :data:`kvpatch.DEFAULT_POLICY` (``keydiff:0.5/window=64``).
    chat_template : bool, default True
        Put the context and question into the tokenizer's chat template (when it has one);
        without one, each question is continued as written (a base model's completion prefix,
        e.g. ``"The meeting with Dana is in room"``).
    separator : str, default "\\n\\n"
        Between the context and the question.
    Other keyword arguments of a call go to ``generate`` (``max_new_tokens``, ``do_sample``...).
    """

    def __call__(self, context, question: str | None = None, questions=None, **kwargs):
        if (question is None) == (questions is None):
            raise ValueError("give a question= or questions=[...] (one of them) with context=")
        if isinstance(context, CompressedContext):
            if context.model is not self.model:
                raise ValueError("this compressed context belongs to another model")
            if kwargs.get("policy") is not None:
                raise ValueError("a compressed context keeps its own policy: give no policy=")
        elif not isinstance(context, str) or not context:
            raise ValueError(
                f"context must be non-empty text or a CompressedContext, got {context!r}"
            )
        asked = [question] if question is not None else list(questions)
        if not asked or not all(isinstance(q, str) and q for q in asked):
            raise ValueError(f"questions must be non-empty strings, got {asked!r}")
        answers = super().__call__({"context": context, "questions": asked}, **kwargs)
        return answers[0] if question is not None else answers

    def _sanitize_parameters(self, policy=None, chat_template=None, separator=None, **generate):
        preprocess = {}
        if chat_template is not None:
            preprocess["chat_template"] = chat_template
        if separator is not None:
            preprocess["separator"] = separator
        forward = {"generate_kwargs": generate}
        if policy is not None:
            forward["policy"] = parse_policy(policy)  # a bad name fails here
        return preprocess, forward, {}

    def preprocess(self, inputs: dict, chat_template: bool = True, separator: str = "\n\n"):
        context = inputs["context"]
        text = context if isinstance(context, str) else ""
        before, after = context_text(self.tokenizer, text, chat_template, separator)
        encode = lambda text: (
            self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        )
        return {
            "context": encode(before) if isinstance(context, str) else context,
            "question_ids": [encode(q + after) for q in inputs["questions"]],
            "questions": inputs["questions"],
        }

    def _forward(self, model_inputs: dict, policy=None, generate_kwargs=None) -> dict:
        model, options = self.model, dict(generate_kwargs or {})
        options.setdefault("do_sample", False)
        if options.get("pad_token_id") is None and self.tokenizer.pad_token_id is not None:
            options["pad_token_id"] = self.tokenizer.pad_token_id
        if not is_enabled(model) and policy is None:
            policy = parse_policy(DEFAULT_POLICY)
        # a model enabled here is disabled after; an enabled one is left as it is
        scope = (
            contextlib.nullcontext()
            if is_enabled(model)
            else enabled(model, policy, self.tokenizer)
        )
        with scope:
            context = model_inputs["context"]
            if not isinstance(context, CompressedContext):
                ids = context.to(model.device)
                context = prefill(model, ids, policy=policy, tokenizer=self.tokenizer)
            questions = [q[0].to(model.device) for q in model_inputs["question_ids"]]
            answers = context.generate_many(questions, **options)
        stats = context.cache.stats()
        return {"answers": answers, "questions": model_inputs["questions"], "stats": stats}

    def postprocess(self, model_outputs: dict) -> list[dict]:
        stats = model_outputs["stats"]
        return [
            {
                "question": question,
                "generated_text": self.tokenizer.decode(answer[0], skip_special_tokens=True),
                "kv_bytes": stats.kv_nbytes,
                "index_bytes": stats.index_nbytes,
                "uncompressed_kv_bytes": stats.full_nbytes,
                "ratio": stats.ratio,
            }
            for question, answer in zip(
                model_outputs["questions"], model_outputs["answers"], strict=True
            )
        ]


def context_text(
    tokenizer, context: str, chat_template: bool = True, separator: str = "\n\n"
) -> tuple[str, str]:
    """The text before a question (``context`` and ``separator`` in the chat template's user
    turn) and after it (the end of turn and the assistant's prefix).

    Without a chat template (a base model, or ``chat_template=False``) the question is a
    completion prefix that the model continues as written, after the BOS token the tokenizer
    would add (the text is encoded without special tokens)."""
    if not chat_template or not getattr(tokenizer, "chat_template", None):
        return bos_text(tokenizer) + context + separator, ""
    return split_turn(tokenizer, head=context + separator)


def register() -> None:
    """Make ``pipeline("kvpatch-text-generation", ...)`` known to transformers."""
    PIPELINE_REGISTRY.register_pipeline(
        TASK, pipeline_class=CompressedQAPipeline, pt_model=AutoModelForCausalLM
    )


register()
