"""Exact statistics of paired right/wrong outcomes (two caches on the same
problems): McNemar's exact test and an exact interval for the difference in
pass rates.

Of n problems, b are right with the reference and wrong with the method, c the
reverse. The pass-rate difference (c - b) / n estimates q (2p - 1), where q is
the chance that the two disagree on a problem (m = b + c of n is binomial(n, q))
and p the chance that a disagreement goes the method's way (c of m is
binomial(m, p)). Clopper-Pearson intervals of q and of p, each at level
1 - alpha/2, hold together with probability at least 1 - alpha, so the range of
q (2p - 1) over both is an exact (conservative) interval of the difference. It
does not shrink to a point when the caches rarely disagree: with no
disagreement in 32 problems it is [-0.128, +0.128] (the interval of p alone,
conditional on m, would be [0, 0]).
"""

from math import comb


def binom_cdf(k, n, p):
    """P(X <= k) for X ~ binomial(n, p), summed exactly term by term."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return sum(comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f, target, increasing):
    """p in [0, 1] with f(p) = target, f monotone, by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k, n, alpha=0.05):
    """The exact two-sided (1 - alpha) interval of a binomial proportion, k of n."""
    if n == 0:
        return (0.0, 1.0)
    # lower: P(X >= k | p) = alpha/2, which grows with p;
    # upper: P(X <= k | p) = alpha/2, which falls.
    low = (
        0.0 if k == 0 else _solve(lambda p: 1 - binom_cdf(k - 1, n, p), alpha / 2, increasing=True)
    )
    high = 1.0 if k == n else _solve(lambda p: binom_cdf(k, n, p), alpha / 2, increasing=False)
    return (low, high)


def mcnemar_p(b, c):
    """McNemar's exact two-sided p-value: twice the smaller tail of binomial(b + c, 1/2)."""
    m = b + c
    if m == 0:
        return 1.0
    return min(1.0, 2 * binom_cdf(min(b, c), m, 0.5))


def paired_difference(reference, method, alpha=0.05):
    """Pass-rate difference method - reference over the same problems (two
    equal-length lists of booleans), its exact (1 - alpha) interval, the
    discordant counts and McNemar's p-value."""
    if len(reference) != len(method):
        raise ValueError(
            f"paired outcomes of different lengths: {len(reference)} and {len(method)}"
        )
    n = len(reference)
    b = sum(r and not m for r, m in zip(reference, method))
    c = sum(m and not r for r, m in zip(reference, method))
    q_low, q_high = clopper_pearson(b + c, n, alpha / 2)
    p_low, p_high = clopper_pearson(c, b + c, alpha / 2)
    # q (2p - 1) is monotone in each of q and p: its extremes lie at the corners
    ends = [q * (2 * p - 1) for q in (q_low, q_high) for p in (p_low, p_high)]
    return {
        "n": n,
        "lost": b,
        "gained": c,
        "difference": (c - b) / n if n else 0.0,
        "interval": (min(ends) + 0.0, max(ends) + 0.0),  # + 0.0: no -0.0
        "p_value": mcnemar_p(b, c),
    }
