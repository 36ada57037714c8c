"""The suite's schedule: conftest's list of the longest test files names files that exist, each once
([Note: longest files first] in tests/conftest.py)."""
from __future__ import annotations

from pathlib import Path

import conftest

TESTS_ROOT = Path(conftest.__file__).parent


def test_longest_files_first_names_existing_test_files_once() -> None:
    names = conftest.LONGEST_FILES_FIRST
    missing = [name for name in names if not (TESTS_ROOT / name).is_file()]
    assert not missing, f"LONGEST_FILES_FIRST names files that do not exist (renamed or removed?): {missing}"
    repeated = sorted({name for name in names if names.count(name) > 1})
    assert not repeated, f"LONGEST_FILES_FIRST names these files twice: {repeated}"
