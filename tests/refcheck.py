"""The numpy reference's side of the quantizer checks shared by tests/test_quant.py
(MLX ops path) and tests/test_kernels.py (Metal kernels).

The normalization's best-so-far selection can land on another iterate when
late iterates' imbalances tie within float rounding; a path under test may pick
any iterate within IMB_RTOL of the best, and must then match that iterate.
"""

import numpy as np

from kvarn_mlx import reference as ref

ITERS = 8
TIE = 1e-3  # a code may differ only where |frac((x-lo)/scale) - 0.5| < TIE
MAX_MISMATCH = 0.005  # ... and on fewer than 0.5% of a call's codes
SCALE_RTOL = 1e-5  # a, b, col in float32 storage
IMB_RTOL = 1e-5  # two iterates "tie" if their imbalances are this close


def ref_iterates(M, iters=ITERS):
    """The loop of spec section 2 (as reference.normalize), keeping every iterate:
    a list of (imbalance, sc, sr); iterate 0 is the input itself."""
    M = M.astype(np.float32)
    R, C = M.shape
    log_c = np.zeros((1, C), np.float32)
    log_r = np.zeros((R, 1), np.float32)
    out = [(ref.imbalance(M), np.ones((1, C), np.float32), np.ones((R, 1), np.float32))]
    for _ in range(iters):
        cur = M / np.exp(log_c) / np.exp(log_r)
        log_c = np.clip(log_c + np.log(np.clip(ref.std(cur, 0), 1e-3, 1e3)), -0.3, 10)
        cur = M / np.exp(log_c) / np.exp(log_r)
        log_r = np.clip(log_r + np.log(np.clip(ref.std(cur, 1), 1e-3, 1e3)), -0.3, 10)
        cur = M / np.exp(log_c) / np.exp(log_r)
        out.append((ref.imbalance(cur), np.exp(log_c), np.exp(log_r)))
    return out


def ref_candidates(M, bits):
    """Reference results, lazily, for every iterate whose imbalance ties the best within
    IMB_RTOL. The first is the one reference.normalize selects (checked)."""
    its = ref_iterates(M)
    imbs = np.array([i[0] for i in its])
    best = imbs.min()
    sel = int(np.flatnonzero(imbs == best)[-1])  # best-so-far with "<=": the last minimum
    _, sc_ref, sr_ref = ref.normalize(M, ITERS)
    assert np.array_equal(sc_ref, its[sel][1]) and np.array_equal(sr_ref, its[sel][2])
    order = [sel] + [j for j in range(len(its)) if j != sel and imbs[j] <= best * (1 + IMB_RTOL)]
    for j in order:
        _, sc, sr = its[j]
        balanced = M / sc / sr
        code, scale, lo = ref.rtn(balanced, bits)
        a, b, col = ref.balance_exponents((sr * scale)[:, 0], (sr * lo)[:, 0], sc[0])
        frac = (balanced - lo) / scale
        tie = np.abs(frac - np.floor(frac) - 0.5)
        yield dict(iterate=j, code=code, a=a, b=b, col=col, tie=tie)


def rel_err(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-30)))
