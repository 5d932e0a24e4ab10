"""Is a flaky transformers test kvpatch's doing? Run its check on paired random draws.

transformers' ``test_sdpa_padding_matches_padding_free_with_position_ids`` draws a new random
model and new inputs each run and compares bf16 logits at bf16's epsilon, so it fails now and
then on its own. This script repeats its check on ``--draws`` draws, each with the same config,
weights and inputs for a stock model and for one enabled as :mod:`kvpatch_plugin` enables it (in
``post_init``, inside ``from_pretrained``), and counts, per draw, whether each passes and whether
their logits are bit-identical::

    python tests/external/paired_draws.py --source ~/src/transformers --model gemma2 \\
        --policy ada-snapkv:0 --draws 100

with transformers' checkout (as for ``run_transformers_tests.py``) at the installed version.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpatch_plugin import enable_in_post_init

import kvpatch


class EnableInPostInit:
    """Enables kvpatch on every model built while :attr:`on` is true, as the plugin does."""

    def __init__(self, policy: str):
        self.on = False
        enable_in_post_init(policy, active=lambda: self.on)


def model_test(source: Path, name: str):
    """An instance of the model's test case (``tests/models/NAME/test_modeling_NAME.py``)."""
    sys.path.insert(0, str(source))
    module = importlib.import_module(f"tests.models.{name}.test_modeling_{name}")
    case = next(
        value
        for key, value in vars(module).items()
        if key.endswith("ModelTest") and getattr(value, "__module__", None) == module.__name__
    )
    test = case("test_sdpa_padding_matches_padding_free_with_position_ids")
    test.setUp()
    return test


def padded_and_packed_logits(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens' logits of a left-padded batch, and of the same rows packed in one row
    with restarting position ids (the test's two forwards, without a cache)."""
    positions = torch.cat([torch.arange(n) for n in mask.sum(1).tolist()])[None]
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        packed = model(input_ids=ids[mask.bool()][None], position_ids=positions, use_cache=False)
    return padded[mask.bool()], packed.logits[0]


def passes(padded: torch.Tensor, packed: torch.Tensor) -> bool:
    epsilon = torch.finfo(torch.bfloat16).eps
    return torch.allclose(padded, packed, rtol=epsilon, atol=epsilon)


def one_draw(test, hook: EnableInPostInit) -> tuple[bool, bool, bool]:
    """(stock passes, kvpatch passes, bit-identical logits) on one random draw."""
    model_class = test.all_generative_model_classes[0]
    config, inputs = test.model_tester.prepare_config_and_inputs_for_common()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    if 0 in mask[:, -1]:
        mask = mask.flip(1)  # left padding, as the test makes it
    ids[~mask.bool()] = config.get_text_config().pad_token_id
    hook.on = False
    found = []
    with tempfile.TemporaryDirectory() as folder:
        model_class(config).save_pretrained(folder)
        for enabled in (False, True):
            hook.on = enabled
            model = model_class.from_pretrained(
                folder, dtype=torch.bfloat16, attn_implementation="sdpa"
            ).eval()
            if kvpatch.is_enabled(model) != enabled:
                raise RuntimeError("the post_init hook did not enable kvpatch as asked")
            found.append(padded_and_packed_logits(model, ids, mask))
    (stock_padded, stock_packed), (ours_padded, ours_packed) = found
    identical = torch.equal(stock_padded, ours_padded) and torch.equal(stock_packed, ours_packed)
    return passes(stock_padded, stock_packed), passes(ours_padded, ours_packed), identical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="transformers' checkout")
    parser.add_argument("--model", default="gemma2")
    parser.add_argument("--policy", default="ada-snapkv:0")
    parser.add_argument("--draws", type=int, default=100)
    args = parser.parse_args()
    hook = EnableInPostInit(args.policy)
    test = model_test(args.source, args.model)
    counts = collections.Counter(one_draw(test, hook) for _ in range(args.draws))
    print(f"{args.model}, {args.policy}, {args.draws} draws")
    print("| stock passes | kvpatch passes | bit-identical | draws |\n|---|---|---|---|")
    for (stock, ours, identical), draws in sorted(counts.items(), reverse=True):
        print(f"| {stock} | {ours} | {identical} | {draws} |")


if __name__ == "__main__":
    main()
