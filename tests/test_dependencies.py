"""Dependency floors in pyproject.toml cover the APIs the code calls."""

from __future__ import annotations

import re
import tomllib

import datasets
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import ROOT


def _requirement(name: str) -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    return req


def test_datasets_floor_has_list_feature():
    """data/dataset.py calls ``datasets.List`` and reads parquet files whose metadata names the
    ``List`` feature type; both arrived in datasets 4.0 (3.x raises AttributeError /
    ``Feature type 'List' not found``). The floor must exclude every 3.x release."""
    req = _requirement("datasets")
    assert not req.specifier.contains("3.6.0")
    assert req.specifier.contains("4.0.0")
    assert Version(datasets.__version__) in req.specifier and hasattr(datasets, "List")


def test_transformers_floor_is_the_one_ci_tests_and_admits_sglangs_pin():
    """models/hf_compat.py supports 5.17 on: CI runs the model paths on the floor the Makefile names
    (``make test-transformers-floor``), and SGLang 0.5.23's pin (5.19.0) is inside the range."""
    req = _requirement("transformers")
    floor = re.search(r"^TRANSFORMERS_FLOOR := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert req.specifier.contains(floor) and not req.specifier.contains("5.16.9")
    assert req.specifier.contains("5.19.0") and req.specifier.contains("5.25.0") and not req.specifier.contains("6.0.0")
