"""kvpress's SnapKV on the same 6-digit needles as the README's "Multi-token answers" table.

kvpress (https://github.com/NVIDIA/kvpress) needs transformers < 5.3, so run this from its own
virtualenv, with kvpatch installed there too (for the demo model and the task generator):

    python -m venv /tmp/kvpress-env
    /tmp/kvpress-env/bin/pip install torch==2.13.0 kvpress==0.5.5
    /tmp/kvpress-env/bin/pip install -e ".[demo,eval]"
    /tmp/kvpress-env/bin/python -m benchmarks.kvpress_needles

The samples are those of ``python -m kvpatch.tools.eval --samples 8 --seed 1`` (question in the
prefill): the whole prompt is prefilled under the press, which compresses it after each layer's
attention, then the answer is decoded greedily, as kvpatch's harness does.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kvpatch.cache import cache_nbytes
from kvpatch.tools import demo
from kvpatch.tools.eval import HFCodec, make_samples


def presses(ratio: float) -> dict:
    from kvpress import AdaKVPress, SnapKVPress

    def snapkv():
        return SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)

    return {
        f"kvpress snapkv:{ratio:g}": snapkv(),
        f"kvpress ada-snapkv:{ratio:g}": AdaKVPress(snapkv()),
    }


@torch.no_grad()
def answer(model, ids: torch.Tensor, press, new_tokens: int, eos: int | None):
    cache = DynamicCache(config=model.config)
    with press(model):
        logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
    size = cache_nbytes(cache) / 2**20
    tokens = [int(logits[0, -1].argmax())]
    position = ids.shape[1]
    while len(tokens) < new_tokens and tokens[-1] != eos:
        step = torch.tensor([[tokens[-1]]])
        positions = torch.tensor([[position]])
        logits = model(step, past_key_values=cache, position_ids=positions).logits
        tokens.append(int(logits[0, -1].argmax()))
        position += 1
    return tokens, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--context-tokens", type=int, default=2000)
    args = parser.parse_args()

    torch.set_num_threads(2)
    model, tokenizer = demo.load(download=False)
    codec = HFCodec(tokenizer)
    samples = make_samples(["single"], codec, args.context_tokens, args.samples, args.seed)
    for name, press in presses(args.ratio).items():
        exact = 0
        for sample in samples:
            tokens, size = answer(model, sample.input_ids[None], press, 14, codec.eos_token_id)
            text = codec.decode(tokens)
            exact += sample.score(text) == 1.0
            print(f"{name}: expected {sample.answers[0]}, answered {text!r}, KV {size:.1f} MB")
        print(f"{name}: {exact} / {len(samples)} exact\n", flush=True)


if __name__ == "__main__":
    main()
