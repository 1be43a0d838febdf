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


def test_gpu_run_calls_python3_only_and_names_its_carry():
    """The GPU machine guarantees ``python3``, not ``python`` (its facts: docs/gpu.md): scripts/gpu_run.sh
    runs every step through ``$PY`` (``python3`` unless ``PYTHON`` is set); the wheels it installs are
    git-ignored, so docs/gpu.md names them as the run's carry list."""
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    commands = [line.split("#")[0] for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert 'PY="${PYTHON:-python3}"' in script
    assert not [c for c in commands if re.search(r"(^|[\s;(])python(\d(\.\d+)?)?\s", c)], "a python call not through $PY"
    assert len(re.findall(r'"\$PY" ', script)) >= 8  # setup (pip, checks) and the four steps
    assert "carry list: build/gpu-wheels" in (ROOT / "docs" / "gpu.md").read_text()
