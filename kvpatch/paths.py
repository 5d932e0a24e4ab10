"""Where kvpatch keeps its files: the demo models and the fitted maps of hidden-state scorers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KVPATCH_CACHE``, else ``$XDG_CACHE_HOME/kvpatch``, else ``~/.cache/kvpatch``."""
    if os.environ.get("KVPATCH_CACHE"):
        return Path(os.environ["KVPATCH_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvpatch"
