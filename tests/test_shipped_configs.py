"""Every config shipped in configs/ loads, and every sweep file expands into valid run configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedpcd.resolve import load_config
from fedpcd.sweep.grid import expand_sweep

CONFIGS = sorted((Path(__file__).parent.parent / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_config_is_valid(path):
    if "sweep" in (yaml.safe_load(path.read_text()) or {}):
        runs = expand_sweep(path)
        assert runs and len({c.output_dir for c in runs}) == len(runs)  # one directory per run
    else:
        assert load_config(path).rounds >= 1
