"""The data order is a pure function of (seed, epoch, position): properties, not examples."""

from __future__ import annotations

import json
import subprocess

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.order import Cursor, epoch_permutation, sample_indices
from tests.helpers.processes import PY, REPO, child_env

seeds = st.integers(min_value=0, max_value=2**31 - 1)
sizes = st.integers(min_value=1, max_value=300)
epochs = st.integers(min_value=0, max_value=10_000)


@given(seeds, sizes, epochs)
def test_each_epoch_is_a_permutation_of_the_dataset(seed, n, epoch):
    assert sorted(epoch_permutation(seed, epoch, n)) == list(range(n))


@given(seeds, sizes, st.integers(min_value=0, max_value=5))
def test_every_epoch_window_visits_every_sample_exactly_once(seed, n, epoch):
    window = sample_indices(seed, n, epoch * n, n)
    assert sorted(window) == list(range(n))


@given(seeds, sizes, st.integers(min_value=0, max_value=2000), st.integers(min_value=0, max_value=700))
def test_resuming_at_any_count_continues_with_the_same_next_sample(seed, n, stop_at, more):
    """A run that stops after `stop_at` samples and resumes sees exactly what an uninterrupted run sees."""
    uninterrupted = sample_indices(seed, n, 0, stop_at + more)
    before = sample_indices(seed, n, 0, stop_at)
    # A fresh computation with nothing carried over but the count (the cache is cleared as a new process would).
    epoch_permutation.cache_clear()
    after = sample_indices(seed, n, stop_at, more)
    assert before + after == uninterrupted


@given(seeds, sizes, st.integers(min_value=0, max_value=5000))
def test_the_cursor_is_epoch_and_position_of_the_count(seed, n, consumed):
    c = Cursor(consumed, n)
    assert c.epoch * n + c.position == consumed and 0 <= c.position < n
    # The sample at the cursor is the epoch's permutation at the position.
    assert sample_indices(seed, n, consumed, 1) == [epoch_permutation(seed, c.epoch, n)[c.position]]


@settings(max_examples=30, deadline=None)  # a busy 2-core machine can take 200 ms for one example
@given(seeds, st.integers(min_value=12, max_value=300))
def test_seeds_and_epochs_really_shuffle(seed, n):
    # For n >= 12 two equal permutations would happen with probability < 1/12! : a real difference, not luck.
    assert epoch_permutation(seed, 0, n) != epoch_permutation(seed + 1, 0, n)
    assert epoch_permutation(seed, 0, n) != epoch_permutation(seed, 1, n)
    assert list(epoch_permutation(seed, 0, n)) != list(range(n))


def test_the_order_does_not_depend_on_the_process():
    """Hash randomisation, import order and caches of another interpreter change nothing."""
    cases = [(0, 7, 0, 20), (42, 100, 250, 30), (2**31 - 1, 3, 10, 9)]
    code = (
        "import json,sys; from engine.data.order import sample_indices; "
        f"print(json.dumps([sample_indices(*c) for c in {cases!r}]))"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env=child_env(PYTHONHASHSEED="12345"), timeout=60).stdout
    assert json.loads(out) == [sample_indices(*c) for c in cases]
