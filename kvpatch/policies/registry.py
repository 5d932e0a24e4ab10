"""Every name the policy grammar accepts and the class behind it, read without importing torch:
the commands check a policy string before they load anything."""

from __future__ import annotations

import difflib
import importlib

#: what ``kvpatch generate``, ``kvpatch chat``, ``kvpatch bench`` and the pipeline compress with
#: when given no policy. KeyDiff reads no query, so it keeps the facts a question asks for
#: whether the question is in the prompt or comes after the context (0.90 in both placements on
#: the demo model's single needle at 0.5, results/default, where SnapKV-style scorers drop
#: to 0.00-0.20 once the question comes after), costs no extra pass (KVzip's reconstruction
#: triples a prefill) and works everywhere a compressed cache goes (chunked prefills, bounded
#: chats, decode budgets). Its window keeps a short prompt's question whole, as SnapKV's does.
DEFAULT_POLICY = "keydiff:0.5/window=64"
#: for a context compressed once and asked often (``kvpatch compress``): KVzip's reconstruction
#: costs about two more prefills, paid once, and its scores do not depend on the question
DOCUMENT_POLICY = "global-kvzip:0.75"
DOCUMENT_POLICY_REASON = "compressed once and asked often, a document is worth KVzip's extra pass"
DEFAULT_RATIO = 0.5
#: the policy that scores tokens with a fitted map (``kvpatch fit-scorer`` fits it)
HIDDEN_STATE_POLICY = "kvzap"
#: the policy whose scores that map is fitted to (KVzap's paper fits KVzip+'s)
TARGET_POLICY = "kvzip-plus"
#: the policies whose scores a map may be fitted to instead: those reconstructing the context
FIT_TARGETS = (TARGET_POLICY, "kvzip")

#: token scorers by name, as ``module:class`` under kvpatch.policies; each also exists with the
#: prefix ``span-`` and every prefix of :data:`BUDGET_PREFIXES`
TOKEN_SCORERS = {
    "snapkv": "snapkv:SnapKV",
    "tova": "tova:TOVA",
    "knorm": "knorm:Knorm",
    "streamingllm": "streamingllm:StreamingLLM",
    "random": "random:RandomScorer",
    "span-snapkv": "spans:SpanSnapKV",
    "span-tova": "spans:SpanTOVA",
    "kvzip": "kvzip:KVzip",
    "kvzip-plus": "kvzip:KVzipPlus",
    "expected-attention": "expected_attention:ExpectedAttention",
    "keydiff": "keydiff:KeyDiff",
    "kvzap": "kvzap:KVzap",
}
#: a kept token brings the tokens after it (:class:`~kvpatch.policies.spans.Spans`)
SPAN_PREFIX = "span-"
SPANS = "spans:Spans"
#: prefixes that share a token scorer's budget differently
BUDGET_PREFIXES = {
    "ada-": "adakv:AdaKV",
    "global-": "layer_budgets:GlobalBudgets",
    "pyramid-": "pyramid:Pyramid",
}
#: channel selectors by name
CHANNEL_SELECTORS = {"think": "think:ThinK", "think-v": "think:ThinKValues"}


def policy_class(where: str) -> type:
    """The class at ``module:class`` under kvpatch.policies."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(f"kvpatch.policies.{module}"), name)


def policy_classes() -> list[type]:
    """Every class the grammar names, their modules imported (a saved context's policy is
    rebuilt from these and from subclasses already imported, never from a module a file names)."""
    places = [
        *TOKEN_SCORERS.values(),
        SPANS,
        *BUDGET_PREFIXES.values(),
        *CHANNEL_SELECTORS.values(),
    ]
    return [policy_class(where) for where in places]


def scorer_names() -> list[str]:
    """The token scorers' names, each also with ``span-`` in front (once)."""
    spanned = [f"{SPAN_PREFIX}{n}" for n in TOKEN_SCORERS if not n.startswith(SPAN_PREFIX)]
    return [*TOKEN_SCORERS, *(n for n in spanned if n not in TOKEN_SCORERS)]


def policy_names() -> list[str]:
    """Every name the policy grammar accepts."""
    scorers = scorer_names()
    prefixed = [f"{prefix}{n}" for prefix in BUDGET_PREFIXES for n in scorers]
    return [*scorers, *prefixed, *CHANNEL_SELECTORS]


def term_name(term: str) -> str:
    """The name of one policy term ``NAME[:RATIO][/FIELD=VALUE,...]``, as the grammar reads it."""
    return term.partition("/")[0].partition(":")[0].strip().lower()


def check_policy_names(spec: str) -> None:
    """A ValueError naming the close matches and the valid names when a term of the policy
    string ``spec`` names no policy (its ratios and settings are checked when it is parsed)."""
    for term in spec.split("+"):
        name = term_name(term)
        if name and name not in policy_names():
            raise ValueError(unknown_name_message(name))


def unknown_name_message(name: str) -> str:
    close = difflib.get_close_matches(name, policy_names(), n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"unknown policy {name!r}.{hint}\n"
        f"  token scorers: {', '.join(TOKEN_SCORERS)}\n"
        f"  prefixes: {SPAN_PREFIX} (spans), then {', '.join(BUDGET_PREFIXES)} (budgets), "
        f"e.g. 'ada-{SPAN_PREFIX}snapkv'\n"
        f"  channels: {', '.join(CHANNEL_SELECTORS)} (join terms with '+', e.g. "
        "'think:0.5+snapkv:0.5')"
    )
