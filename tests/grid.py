"""Parameter grids cut to covering cases for the default run.

A grid lists every combination of its axes' values. The default suite runs the
covering cases only; the other combinations carry `@pytest.mark.slow` and run
with `-m slow` (docs/testing.md). Covering cases are chosen so that every value
of every axis runs at least once, and each grid says which code paths its
covering cases reach.
"""

import itertools

import pytest


def diagonal(*axes):
    """Case i takes value i mod len(axis) of each axis: every value of every axis
    runs once, in max(len(axis)) cases."""
    n = max(len(a) for a in axes)
    return [tuple(a[i % len(a)] for a in axes) for i in range(n)]


def grid(*axes, covering, ids=None):
    """pytest parameters for every combination of the axes' values; those not in
    `covering` are marked slow. ids(case) names a case (default: pytest's)."""
    cases = list(itertools.product(*axes))
    missing = [c for c in covering if c not in cases]
    if missing:
        raise ValueError(f"covering cases outside the grid: {missing}")
    keep = set(covering)
    return [
        pytest.param(*c, marks=() if c in keep else pytest.mark.slow, id=ids(c) if ids else None)
        for c in cases
    ]
