"""The policy grammar: a string such as ``"think:0.25+ada-snapkv:0.75/window=32"`` as a
:class:`~kvpatch.policies.base.Policy` (the grammar is in :mod:`kvpatch.policies`' docstring, the
names in :mod:`~kvpatch.policies.registry`)."""

from __future__ import annotations

import dataclasses

from kvpatch.policies.base import ChannelSelector, Policy, TokenScorer, compose
from kvpatch.policies.contract import check_ratio
from kvpatch.policies.registry import (
    BUDGET_PREFIXES,
    CHANNEL_SELECTORS,
    DEFAULT_RATIO,
    SPAN_PREFIX,
    SPANS,
    TOKEN_SCORERS,
    policy_class,
    unknown_name_message,
)


def _scorer_class(name: str) -> type[TokenScorer] | None:
    return policy_class(TOKEN_SCORERS[name]) if name in TOKEN_SCORERS else None


def _token_scorer(name: str, ratio: float) -> TokenScorer | None:
    """``NAME`` or ``span-NAME`` (:class:`Spans` around it) as a scorer, or None."""
    if name in TOKEN_SCORERS:
        return _scorer_class(name)(ratio=ratio)
    inner = name.removeprefix(SPAN_PREFIX)
    if inner != name and inner in TOKEN_SCORERS:
        return policy_class(SPANS)(_scorer_class(inner)(ratio=ratio))
    return None


def _parse_term(term: str) -> Policy:
    term, _, settings = term.partition("/")
    policy = _parse_named(term)
    for setting in filter(None, (s.strip() for s in settings.split(","))):
        _apply_setting(policy, setting, term.strip())
    return policy


def _wrapped(policy: Policy) -> list[Policy]:
    """``policy``, the token scorer it wraps, the one that wraps, and so on."""
    chain = [policy]
    while getattr(chain[-1], "scorer", None) is not None:
        chain.append(chain[-1].scorer)
    return chain


def _apply_setting(policy: Policy, setting: str, term: str) -> None:
    """Set ``FIELD=VALUE`` on ``policy``, or on the first token scorer it wraps that has the field
    (``global-span-kvzip/span_before=0`` reaches KVzip through the budget and the span), and
    check it again."""
    field, sep, text = (part.strip() for part in setting.partition("="))
    owners = _wrapped(policy)
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
            return policy_class(wrapper)(scorer)
    if name in CHANNEL_SELECTORS:
        selector: type[ChannelSelector] = policy_class(CHANNEL_SELECTORS[name])
        return selector(ratio=ratio)
    raise ValueError(unknown_name_message(name))


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
