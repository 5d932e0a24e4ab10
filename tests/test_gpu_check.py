"""The GPU check's CPU dry run: benchmarks/gpu_check.sh runs its test step and its benchmark with
tiny shapes, and reports every configuration it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
READINGS = ("padded, default", "packed, default", "padded, no-cudnn")
READINGS = ("padded, default", "packed, default", "padded, no-cudnn")
CONFIGURATIONS = {"full", "limit:0.75", "snapkv:0.75", "ada-snapkv:0.75", "think:0.5+snapkv:0.75"}


@pytest.mark.slow
def test_dry_run_reports_every_configuration(tmp_path):
    out = tmp_path / "out"
    script = ROOT / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(script), "--dry-run", str(out)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in (out / "tests.log").read_text()
    report = json.loads((out / "results.json").read_text())
    assert report["environment"]["device"]
    contexts = {256, 512}
    decoded = {(r["context"], r["batch"], r["reading"], r["policy"]) for r in report["decode"]}
    assert decoded == {
        (c, b, reading, p)
        for c in contexts
        for b in (1, 2)
        for reading in READINGS
        for p in CONFIGURATIONS
    }
    assert all(r["decode_s"] > 0 and r["kv_bytes"] > 0 for r in report["decode"])
    stored = {(r["context"], r["policy"]): r["kv_bytes"] for r in report["memory"]}
    assert set(stored) == {(c, p) for c in contexts for p in CONFIGURATIONS}
    for c in contexts:  # a quarter of the tokens kept: about a quarter of the bytes
        assert stored[(c, "snapkv:0.75")] < 0.4 * stored[(c, "full")]
        assert stored[(c, "limit:0.75")] < 0.4 * stored[(c, "full")]
    prefilled = {(r["context"], r["policy"]) for r in report["prefill"]}
    assert (512, "global-kvzip:0.75/normalise=chunk") in prefilled
    assert (512, "global-kvzip:0.75/normalise=context") not in prefilled  # above its maximum
    table = (out / "results.md").read_text()
    kernels = {(r["context"], r["kernel"]) for r in report["kernels"]}
    assert (256, "math") in kernels and (512, "default") in kernels
    for heading in ("sdpa call", "Decode", "Memory", "Prefill cost"):
        assert heading in table
    capacity = json.loads((out / "capacity.json").read_text())["capacity"]
    fits = {r["configuration"]: r["batch"] for r in capacity}
    assert set(fits) == {
        "full",
        "ada-snapkv:0.75",
        "think:0.5+ada-snapkv:0.75",
        "ada-snapkv:0.75@int4",
    }
    # a quarter of the tokens kept: several times the rows in the same memory
    compressed = [batch for name, batch in fits.items() if name != "full"]
    assert fits["full"] >= 1 and all(batch >= 3 * fits["full"] for batch in compressed)
    assert "Largest batch" in (out / "capacity.md").read_text()


def test_unknown_option_is_refused():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    result = subprocess.run(["bash", str(script), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown option --fast" in result.stderr and "--dry-run" in result.stderr
