"""The tools around the core: the ``kvpatch`` command (:mod:`~kvpatch.tools.cli`), the eval
harness (:mod:`~kvpatch.tools.eval`), the decode benchmark (:mod:`~kvpatch.tools.bench`), the
real demo models (:mod:`~kvpatch.tools.demo`), fitting a hidden-state scorer's map
(:mod:`~kvpatch.tools.fitting`, with :mod:`~kvpatch.tools.regression` and
:mod:`~kvpatch.tools.training_text`), the models the commands load
(:mod:`~kvpatch.tools.loading`), what they show on a terminal (:mod:`~kvpatch.tools.terminal`)
and tiny random models for tests and benchmarks (:mod:`~kvpatch.tools.testing`).

The core (cache, policies, attention, patching, compat, contexts, saving) never imports them.
"""
