"""Pearson's chi-square tests for the speculative sampling tests (no scipy here): goodness of
fit against known probabilities, and homogeneity of two samples, with exact p-values from
the regularized upper incomplete gamma function (series / continued fraction, as in
Numerical Recipes' gammq)."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df)."""
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    if z < a + 1.0:
        return 1.0 - _lower_series(a, z)
    return _upper_fraction(a, z)


def _lower_series(a: float, z: float) -> float:
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
        n += 1.0
        term *= z / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-z + a * math.log(z) - math.lgamma(a))


def _upper_fraction(a: float, z: float) -> float:
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def goodness_of_fit(observed: Sequence[Hashable], probs: dict, min_expected: float = 5.0) -> float:
    """p-value of the observed outcomes against the probabilities (rare outcomes pooled)."""
    counts = Counter(observed)
    n = len(observed)
    unexpected = [k for k in counts if probs.get(k, 0.0) <= 0.0]
    assert not unexpected, f"outcomes with probability 0 were observed: {unexpected}"
    cells: list[tuple[float, float]] = []
    pooled_obs = pooled_exp = 0.0
    for key, p in probs.items():
        if p * n >= min_expected:
            cells.append((counts.get(key, 0), p * n))
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += p * n
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


def homogeneity(first: Sequence[Hashable], second: Sequence[Hashable],
                min_expected: float = 5.0) -> float:
    """p-value that two samples come from the same distribution (2 x k contingency table;
    outcomes too rare for the test are pooled into one cell)."""
    a, b = Counter(first), Counter(second)
    n_a, n_b = len(first), len(second)
    total = n_a + n_b
    cells: list[tuple[float, float]] = []
    rare_a = rare_b = 0.0
    for key in set(a) | set(b):
        column = a[key] + b[key]
        if min(column * n_a, column * n_b) / total >= min_expected:
            cells.append((a[key], b[key]))
        else:
            rare_a, rare_b = rare_a + a[key], rare_b + b[key]
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    stat = 0.0
    for o_a, o_b in cells:
        column = o_a + o_b
        e_a, e_b = column * n_a / total, column * n_b / total
        stat += (o_a - e_a) ** 2 / e_a + (o_b - e_b) ** 2 / e_b
    return chi2_sf(stat, max(1, len(cells) - 1))
