"""A numpy workload for ferry's churn tests: least-squares fitting by gradient descent
(float64), integer matrix products and histograms (int64), a generator of batches and a
dict of results — suspended and resumed many times, it must print exactly what an
uninterrupted run prints. Usage: numpy_fit.py [ROUNDS]"""
import sys

import numpy as np

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
rng = np.random.default_rng(2026)
X = rng.normal(size=(4000, 16))
w_true = np.linspace(-2.0, 2.0, 16)
y = X @ w_true + rng.normal(scale=0.05, size=4000)


def batches(n, size):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


w = np.zeros(16)
results = {}
for r in range(rounds):
    for b in batches(len(y), 500):
        grad = X[b].T @ (X[b] @ w - y[b]) / (b.stop - b.start)
        w -= 0.05 * grad
    m = np.arange(r, r + 64, dtype=np.int64).reshape(8, 8)
    mm = m @ m.T
    hist = np.bincount((np.abs(X[:, r % 16]) * 4).astype(np.int64), minlength=8)[:8]
    loss = float(np.mean((X @ w - y) ** 2))
    results[r] = (round(loss, 9), int(mm.trace()), hist.astype(np.int64).tolist())
    if r % max(1, rounds // 100) == 0:
        print(r, results[r], flush=True)
print("weights", np.round(w, 6).tolist())
print("checksum", sum(v[1] for v in results.values()), mm.dtype, hist.dtype)
