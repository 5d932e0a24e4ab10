"""A pytest plugin that turns kvpatch on in every causal language model a test suite builds.

Load it into a suite kvpatch did not write (transformers' own model tests) to judge kvpatch by
that suite's expectations::

    KVPATCH_POLICY=snapkv:0 python -m pytest -p kvpatch_plugin PATH/tests/...

with this folder and this repository's root on ``PYTHONPATH`` (the plugin goes by its own name:
transformers' checkout has a ``tests`` package of its own). Every model whose class can
``generate`` gets ``kvpatch.enable(model, KVPATCH_POLICY)`` as its ``__init__`` ends
(``post_init``), so that whatever the test does next (moving it, switching its attention
implementation, generating) happens to an enabled model. Without ``KVPATCH_POLICY`` the plugin
does nothing.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "KVPATCH_POLICY"
_restore = None


def wants_kvpatch(model) -> bool:
    """A model kvpatch compresses: one that generates text from a decoder with attention."""
    can_generate = getattr(type(model), "can_generate", None)
    return bool(can_generate and can_generate()) and hasattr(model.config, "num_hidden_layers")


def enable_in_post_init(policy: str, active=lambda: True):
    """Make every model that :func:`wants_kvpatch` built from now on enabled with ``policy`` as
    its ``post_init`` ends (while ``active()`` is true); returns what undoes it."""
    import transformers

    import kvpatch

    kvpatch.parse_policy(policy)  # a bad policy stops here, with kvpatch's error
    original = transformers.PreTrainedModel.post_init

    def post_init(self):
        original(self)
        if active() and wants_kvpatch(self) and not kvpatch.is_enabled(self):
            kvpatch.enable(self, policy)

    transformers.PreTrainedModel.post_init = post_init

    def restore():
        transformers.PreTrainedModel.post_init = original

    return restore


def pytest_configure(config):
    policy = os.environ.get(ENVIRONMENT_VARIABLE)
    if policy:
        global _restore
        _restore = enable_in_post_init(policy)


def pytest_unconfigure(config):
    global _restore
    if _restore is not None:
        _restore()
        _restore = None


def pytest_report_header(config):
    policy = os.environ.get(ENVIRONMENT_VARIABLE)
    return f"kvpatch enabled on every generating model: {policy}" if policy else None
