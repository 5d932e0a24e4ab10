"""The contract between a compressed layer and the attention function: a typed request posted
for the exact keys ``update`` returns, taken once by the attention call that gets those keys;
nothing is attached to the tensors."""

from __future__ import annotations

import gc
import threading

import torch
from conftest import make_model, prompt

import kvpatch
from kvpatch.cache import PackedRequest, PaddedRequest, PrefillRequest, peek, post, take


def test_a_request_is_for_the_keys_it_was_posted_with_and_is_read_once():
    keys, other = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    request = PrefillRequest(layer=None)
    assert post(keys, request) is keys
    assert take(other) is None  # equal values, another tensor: not its request
    assert peek(keys) is request and take(keys) is request
    assert take(keys) is None  # read once


def test_a_request_does_not_keep_its_keys_alive():
    keys = torch.zeros(1, 2, 3, 4)
    post(keys, PrefillRequest(layer=None))
    del keys
    gc.collect()
    assert take(torch.zeros(1, 2, 3, 4)) is None


def test_requests_are_per_thread():
    keys = torch.zeros(1, 2, 3, 4)
    post(keys, PrefillRequest(layer=None))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(take(keys)))
    thread.start()
    thread.join()
    assert seen == [None] and take(keys) is not None


def test_every_layer_step_is_served_from_its_request_and_no_tensor_carries_state(monkeypatch):
    """A prefill and two decode steps through a compressed cache: each layer's ``update`` posts
    one request, the attention call takes it (nothing is left), and the tensors returned have no
    attribute of kvpatch's."""
    from kvpatch.cache import requests

    posted, taken, returned = [], [], []
    real_post, real_take = requests.post, requests.take

    def recording_post(keys, request):
        posted.append(type(request).__name__)
        returned.append(keys)
        return real_post(keys, request)

    def recording_take(keys):
        request = real_take(keys)
        taken.append(type(request).__name__ if request is not None else None)
        return request

    for module in ("kvpatch.cache.layer", "kvpatch.cache.store", "kvpatch.cache.shared_context"):
        monkeypatch.setattr(f"{module}.post", recording_post)
    monkeypatch.setattr("kvpatch.attention.take", recording_take)
    model, ids = make_model(), prompt(40)
    layers = model.config.num_hidden_layers
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert posted[:layers] == [PrefillRequest.__name__] * layers
    assert set(posted[layers:]) <= {PackedRequest.__name__, PaddedRequest.__name__}
    assert len(posted) == 3 * layers  # the prefill and two decode steps
    assert [t for t in taken if t is not None] == posted
    assert all(not vars(keys) for keys in returned)
