"""This project's top-level packages are the ones imported, whatever else is installed beside them.

Hugging Face's ``kernels`` package (a dependency of transformers from 5.25) installs a top-level
``kernels`` module; this project's kernels' package was called that until 2026-12-03 and was
shadowed by it (docs/DESIGN.md, the layers table). Both checks fail on a tree that imports the old
name.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("overlap", "overlap_kernels", "scheduler")
TAKEN_NAMES = ("kernels",)
"""Top-level names other distributions install that this tree must not import."""


def test_the_packages_are_the_ones_pyproject_installs() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(found) == sorted(f"{name}*" for name in PACKAGES)
    for name in PACKAGES:
        assert (REPO / name / "__init__.py").is_file(), name


def test_no_file_imports_a_name_another_distribution_installs() -> None:
    pattern = re.compile(r"^\s*(?:from|import)\s+(" + "|".join(TAKEN_NAMES) + r")\b", re.MULTILINE)
    offenders = []
    for folder in (*PACKAGES, "tests", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            offenders += [f"{path.relative_to(REPO)}: {m.group(0).strip()}" for m in pattern.finditer(path.read_text())]
    assert not offenders, offenders


def test_a_kernels_module_first_on_the_path_does_not_shadow_ours(tmp_path: Path) -> None:
    """What an environment with Hugging Face's ``kernels`` looks like to Python: another top-level
    ``kernels`` found before this checkout. ``overlap`` still imports, with this checkout's kernels."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("IMPOSTOR = True\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = ("import kernels, overlap, overlap_kernels; "
            "print(kernels.IMPOSTOR, overlap_kernels.__file__, overlap_kernels.ShardLayout.__module__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    impostor, where, module = out.stdout.split()
    assert impostor == "True" and Path(where).resolve().is_relative_to(REPO / "overlap_kernels"), out.stdout
    assert module.startswith("overlap_kernels."), module
