"""``scheduler.cost_samples.least_disturbed``: per entry, the least measured value of several recorded
steps ([Note: robust step costs]). Pure arithmetic on hand-made tables: exact."""
from __future__ import annotations

import pytest

from scheduler.cost_samples import least_disturbed


def test_each_entry_is_the_least_of_its_samples_wherever_the_spikes_fall() -> None:
    # [step][position][compute, link, packing, backward]; a spike in a different entry of each step
    steps = [[[0.9, 0.2, 0.1, 0.4], [1.0, 0.3, 0.1, 2.0]],
             [[1.0, 0.6, 0.1, 0.5], [1.1, 0.3, 0.2, 0.8]],
             [[1.1, 0.2, 0.3, 0.5], [1.0, 0.4, 0.1, 0.9]]]
    assert least_disturbed(steps) == [[0.9, 0.2, 0.1, 0.4], [1.0, 0.3, 0.1, 0.8]]
    assert least_disturbed(steps[:1]) == steps[0]  # one sample: itself


def test_unmeasured_entries_are_left_out() -> None:
    # a recorded forward without backward marks its backward -1: the others' samples decide
    steps = [[[1.0, 0.1, 0.0, -1.0]], [[2.0, 0.2, 0.0, 3.0]], [[3.0, 0.3, 0.0, 4.0]]]
    assert least_disturbed(steps) == [[1.0, 0.1, 0.0, 3.0]]
    # measured nowhere: stays unmeasured
    assert least_disturbed([[[1.0, -1.0]], [[2.0, -1.0]]]) == [[1.0, -1.0]]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="samples must hold at least one table"):
        least_disturbed([])
    with pytest.raises(ValueError, match="sample 1 has rows of"):
        least_disturbed([[[1.0, 2.0]], [[1.0]]])
    with pytest.raises(ValueError, match="sample 1 has rows of"):
        least_disturbed([[[1.0]], [[1.0], [2.0]]])
