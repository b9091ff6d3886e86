"""Is the output change linear or logarithmic in depth? Least-squares fits on output_change.md.

    .venv/bin/python experiments/norm_depth/fit_shape.py
For each variant and output (encoder / decoder): R² and slope of y ~ a·N + b and y ~ a·ln N + b,
and y(N_max) / y(N_min).
"""
import re
from pathlib import Path

import numpy as np

rows = [line for line in (Path(__file__).parent / "output_change.md").read_text().splitlines()
        if re.match(r"\| \d", line)]
header = next(line for line in (Path(__file__).parent / "output_change.md").read_text().splitlines()
              if line.startswith("| layers"))
variants = [v.strip() for v in header.split("|")[2:-1]]
N = np.array([float(r.split("|")[1]) for r in rows])


def fit(x, y):
    A = np.vstack([x, np.ones_like(x)]).T
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    pred = A @ coef
    return 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum(), coef[0]


print("| variant | output | linear R² (slope) | log R² (slope) | y(max N) / y(min N) |")
print("|---|---|---|---|---|")
for i, v in enumerate(variants):
    for k, out in enumerate(("encoder", "decoder")):
        y = np.array([float(r.split("|")[2 + i].split("/")[k]) for r in rows])
        (r2l, sl), (r2g, sg) = fit(N, y), fit(np.log(N), y)
        print(f"| {v} | {out} | {r2l:.3f} ({sl:.3f}) | {r2g:.3f} ({sg:.3f}) | {y[-1] / y[0]:.2f} |")
