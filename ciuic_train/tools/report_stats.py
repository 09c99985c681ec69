"""The ablation report's statistics: Student's t distribution and Welch's test.

Written out (the incomplete beta function by its continued fraction, the quantile by
bisection) so that `ciuic-train-report` needs no scipy; tests/test_report.py checks them
against known values. ALPHA is the report's significance level and CI coverage (95%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function, by the modified Lentz method."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for coef in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + coef * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + coef / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The continued fraction converges fast only below (a+1)/(a+b+2); use the symmetry above it.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom (df may be fractional)."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|)."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(prob: float, df: float) -> float:
    """Inverse of t_cdf by bisection: plenty fast for a handful of CI widths."""
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > prob:
        lo *= 2.0
    while t_cdf(hi, df) < prob:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < prob:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95% Student-t interval (None below 2 values)."""
    n = len(values)
    mean = float(np.mean(values))
    if n < 2:
        return mean, None
    sem = float(np.std(values, ddof=1)) / math.sqrt(n)
    return mean, t_quantile(1 - ALPHA / 2, n - 1) * sem


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """Welch–Satterthwaite degrees of freedom from sample variances and sizes."""
    qa, qb = var_a / n_a, var_b / n_b
    return (qa + qb) ** 2 / (qa * qa / (n_a - 1) + qb * qb / (n_b - 1))


@dataclass
class Welch:
    diff: float
    ci: tuple[float, float]
    t: float
    df: float
    p: float


def welch_test(a: list[float], b: list[float]) -> Welch:
    """Difference of means a - b with its 95% CI and two-sided p-value, variances not pooled."""
    var_a, var_b = float(np.var(a, ddof=1)), float(np.var(b, ddof=1))
    n_a, n_b = len(a), len(b)
    diff = float(np.mean(a) - np.mean(b))
    se = math.sqrt(var_a / n_a + var_b / n_b)
    if se == 0.0:  # every seed gave the same number in both groups: the difference is exact
        return Welch(diff, (diff, diff), math.copysign(math.inf, diff) if diff else 0.0, math.inf, 0.0 if diff else 1.0)
    df = welch_df(var_a, n_a, var_b, n_b)
    t = diff / se
    half = t_quantile(1 - ALPHA / 2, df) * se
    return Welch(diff, (diff - half, diff + half), t, df, t_two_sided_p(t, df))
