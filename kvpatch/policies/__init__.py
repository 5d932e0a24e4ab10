"""Compression policies: what each layer keeps.

A policy is given as an object (``SnapKV(ratio=0.5, window=32)``) or as a string in the grammar
``term ("+" term)*`` with ``term = NAME [":" RATIO] ["/" FIELD "=" VALUE ("," FIELD "=" VALUE)*]``,
RATIO being the fraction removed (default 0.5) and the settings fields of the policy (or of the
token scorer it wraps), e.g. ``"snapkv:0.5/window=32,n_sink=0"``:
``"snapkv"``, ``"ada-snapkv:0.75"``, ``"think:0.25+ada-snapkv:0.75"``; up to three terms combine,
one of each kind: key channels (``think``), value channels (``think-v``) and tokens, e.g.
``"think:0.5+think-v:0.25+ada-snapkv:0.5"``. A token scorer's name
takes the prefix ``span-`` (:class:`Spans`: a kept token brings the tokens after it), then
``ada-`` (head-wise budgets in each layer), ``global-`` (one budget shared by every layer and
head) or ``pyramid-`` (layer budgets shrinking with depth): ``"ada-span-kvzip:0.75"``.
"""

from __future__ import annotations

import dataclasses
import difflib

from kvpatch.policies.adakv import AdaKV
from kvpatch.policies.base import ChannelSelector, Composed, Policy, TokenScorer, compose
from kvpatch.policies.contract import LayerInputs, Plan, check_ratio, replay_needed
from kvpatch.policies.expected_attention import ExpectedAttention
from kvpatch.policies.keydiff import KeyDiff
from kvpatch.policies.knorm import Knorm
from kvpatch.policies.kvzap import HiddenStateMap, KVzap, hidden_state_scorer
from kvpatch.policies.kvzip import KVzip, KVzipPlus
from kvpatch.policies.layer_budgets import GlobalBudgets
from kvpatch.policies.pyramid import Pyramid
from kvpatch.policies.random import RandomScorer
from kvpatch.policies.snapkv import SnapKV
from kvpatch.policies.spans import Spans, SpanSnapKV, SpanTOVA
from kvpatch.policies.streamingllm import StreamingLLM
from kvpatch.policies.think import ThinK, ThinKValues
from kvpatch.policies.tova import TOVA

#: what ``kvpatch generate``, ``kvpatch chat``, ``kvpatch bench`` and the pipeline compress with
#: when given no policy. KeyDiff reads no query, so it keeps the facts a question asks for
#: whether the question is in the prompt or comes after the context (0.90 in both placements on
#: the demo model's single needle at 0.5, docs/results-default, where SnapKV-style scorers drop
#: to 0.00-0.20 once the question comes after), costs no extra pass (KVzip's reconstruction
#: triples a prefill) and works everywhere a compressed cache goes (chunked prefills, bounded
#: chats, decode budgets). Its window keeps a short prompt's question whole, as SnapKV's does.
DEFAULT_POLICY = "keydiff:0.5/window=64"

#: token scorers by name; each also exists with every prefix of :data:`BUDGET_PREFIXES`
TOKEN_SCORERS: dict[str, type[TokenScorer]] = {
    cls.name: cls
    for cls in (
        SnapKV,
        TOVA,
        Knorm,
        StreamingLLM,
        RandomScorer,
        SpanSnapKV,
        SpanTOVA,
        KVzip,
        KVzipPlus,
        ExpectedAttention,
        KeyDiff,
        KVzap,
    )
}
#: prefixes that share a token scorer's budget differently
BUDGET_PREFIXES = {"ada-": AdaKV, "global-": GlobalBudgets, "pyramid-": Pyramid}
#: channel selectors by name
CHANNEL_SELECTORS: dict[str, type[ChannelSelector]] = {
    ThinK.name: ThinK,
    ThinKValues.name: ThinKValues,
}

DEFAULT_RATIO = 0.5


def policy_names() -> list[str]:
    """Every name the policy grammar accepts."""
    scorers = list(TOKEN_SCORERS)
    scorers += [f"span-{n}" for n in TOKEN_SCORERS if f"span-{n}" not in TOKEN_SCORERS]
    scorers = [n for n in scorers if not n.startswith("span-span-")]
    prefixed = [f"{prefix}{n}" for prefix in BUDGET_PREFIXES for n in scorers]
    return [*scorers, *prefixed, *CHANNEL_SELECTORS]


def _token_scorer(name: str, ratio: float) -> TokenScorer | None:
    """``NAME`` or ``span-NAME`` (:class:`Spans` around it) as a scorer, or None."""
    if name in TOKEN_SCORERS:
        return TOKEN_SCORERS[name](ratio=ratio)
    if name.startswith("span-") and name[5:] in TOKEN_SCORERS:
        return Spans(TOKEN_SCORERS[name[5:]](ratio=ratio))
    return None


def _parse_term(term: str) -> Policy:
    term, _, settings = term.partition("/")
    policy = _parse_named(term)
    for setting in filter(None, (s.strip() for s in settings.split(","))):
        _apply_setting(policy, setting, term.strip())
    return policy


def _apply_setting(policy: Policy, setting: str, term: str) -> None:
    """Set ``FIELD=VALUE`` on ``policy``, or on the token scorer it wraps, and check it again."""
    field, sep, text = (part.strip() for part in setting.partition("="))
    owners = [policy, getattr(policy, "scorer", None)]
    owner = next((o for o in owners if dataclasses.is_dataclass(o) and field in _fields(o)), None)
    if not sep or owner is None or field == "ratio":
        valid = sorted({f for o in owners if dataclasses.is_dataclass(o) for f in _fields(o)})
        valid = [f for f in valid if f not in ("ratio", "scorer")]
        raise ValueError(
            f"bad setting {setting!r} in policy term {term!r}: expected FIELD=VALUE with FIELD "
            f"one of {', '.join(valid)} (the ratio goes after ':')"
        )
    current = getattr(owner, field)
    try:
        value = _typed(text, current)
    except ValueError:
        raise ValueError(
            f"bad value {text!r} for {field} in policy term {term!r}: expected "
            f"{type(current).__name__}"
        ) from None
    setattr(owner, field, value)
    getattr(owner, "__post_init__", lambda: None)()  # the policy's own checks, on the new value


def _fields(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _typed(text: str, like):
    """``text`` as the type of ``like`` (a bool from true/false, an int, a float or a string)."""
    if isinstance(like, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if isinstance(like, (int, float)):
        return type(like)(text)
    return text


def _parse_named(term: str) -> Policy:
    name, sep, ratio_text = term.strip().partition(":")
    name = name.strip().lower()
    ratio = DEFAULT_RATIO
    if sep:
        try:
            ratio = float(ratio_text)
        except ValueError:
            raise ValueError(
                f"bad ratio {ratio_text.strip()!r} in policy term {term.strip()!r}: "
                "expected a number in [0, 1), the fraction removed"
            ) from None
        check_ratio(ratio, name=f"ratio of {name!r}")
    scorer = _token_scorer(name, ratio)
    if scorer is not None:
        return scorer
    for prefix, wrapper in BUDGET_PREFIXES.items():
        scorer = _token_scorer(name[len(prefix) :], ratio) if name.startswith(prefix) else None
        if scorer is not None:
            return wrapper(scorer)
    if name in CHANNEL_SELECTORS:
        return CHANNEL_SELECTORS[name](ratio=ratio)
    valid = policy_names()
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown policy {name!r}.{hint} Valid names: {', '.join(valid)}")


def parse_policy(spec: str | Policy | None) -> Policy | None:
    """Turn a policy string (or object, or None) into a :class:`Policy`."""
    if spec is None or isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a policy is a string or a Policy object, got {type(spec).__name__}")
    terms = spec.split("+")
    if any(not t.strip() for t in terms):
        raise ValueError(
            f"empty term in policy {spec!r}: expected NAME[:RATIO] terms joined by '+', "
            f"e.g. 'think:0.5+snapkv:0.5'"
        )
    policies = [_parse_term(t) for t in terms]
    if len(policies) == 1:
        return policies[0]
    if len(policies) > 3:
        raise ValueError(
            f"policy {spec!r} has {len(policies)} terms; at most three combine: one key-channel "
            "policy (think), one value-channel policy (think-v) and one token policy"
        )
    return compose(*policies)


__all__ = [
    "DEFAULT_POLICY",
    "TOVA",
    "AdaKV",
    "ChannelSelector",
    "Composed",
    "ExpectedAttention",
    "GlobalBudgets",
    "HiddenStateMap",
    "KVzap",
    "KVzip",
    "KVzipPlus",
    "KeyDiff",
    "Knorm",
    "LayerInputs",
    "Plan",
    "Policy",
    "Pyramid",
    "RandomScorer",
    "SnapKV",
    "SpanSnapKV",
    "SpanTOVA",
    "Spans",
    "StreamingLLM",
    "ThinK",
    "ThinKValues",
    "TokenScorer",
    "compose",
    "hidden_state_scorer",
    "parse_policy",
    "policy_names",
    "replay_needed",
]
