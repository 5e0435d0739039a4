"""Shared test helpers: loading fla-core's pure-PyTorch references without importing fla
(the package import needs triton, which CPU CI does not have)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def load_fla_file(relpath: str):
    """Load ``fla/<relpath>`` as a standalone module, or skip if fla-core is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(spec.submodule_search_locations[0]) / relpath
    mod_spec = importlib.util.spec_from_file_location(f"fla_ref_{path.stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module
