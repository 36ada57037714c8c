"""The supported torch range is one range: pyproject's requirement, the versions ``.ci/run`` tests by default and
``scheduler.torch_versions.SUPPORTED_TORCH`` name the same oldest and newest release."""
from __future__ import annotations

import re
from pathlib import Path

from scheduler.torch_versions import SUPPORTED_TORCH, TORCH_VERSION

REPO = Path(__file__).resolve().parents[2]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_pyproject_ci_and_the_table_name_one_range() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    (low, high), = re.findall(r'"torch>=([\d.]+),<([\d.]+)"', pyproject)
    ci = re.search(r"\|\| versions=\(([\d. ]+)\)", (REPO / ".ci" / "run").read_text())
    assert ci is not None, ".ci/run must name the torch versions it tests by default"
    tested = sorted(_minor(v) for v in ci.group(1).split())
    assert tested[0] == SUPPORTED_TORCH[0] == _minor(low)
    assert tested[-1] == SUPPORTED_TORCH[1] and _minor(high) == (SUPPORTED_TORCH[1][0], SUPPORTED_TORCH[1][1] + 1)


def test_this_torch_is_in_the_supported_range() -> None:
    assert SUPPORTED_TORCH[0] <= TORCH_VERSION <= SUPPORTED_TORCH[1], TORCH_VERSION
