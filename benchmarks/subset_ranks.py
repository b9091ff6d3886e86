"""How well BLEU on a fixed subset of N sentences ranks outputs as BLEU on all of them does: the
question behind eval.valid_subset's N, whose subset BLEU picks a run's best checkpoint.

    python benchmarks/subset_ranks.py                          # deep_bleu_2k's test outputs, N = 100, 200, 400
    python benchmarks/subset_ranks.py --study layerdrop_prune_2k --sizes 200

A study's records keep every run's test hypotheses (runs/<run>/test.hyp.gz) beside the references
(test.ref.gz); the valid hypotheses of the checkpoints a subset ranks are not kept, so the test set
stands in for the valid set (same corpus, same size, the same row rule: evaluation.subset_rows). For
each N: of every pair of runs whose whole-set BLEU differs, how many the subset's BLEU orders the same
way, and how far apart (on the whole set) the pairs it swaps are. Seconds of CPU, no training.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def swapped(full: dict[str, float], sub: dict[str, float]) -> tuple[int, list[tuple[str, str, float]]]:
    """(pairs the whole set orders, [(a, b, whole-set BLEU a - b) for the pairs the subset orders the
    other way or ties]); ties on the whole set are not counted."""
    pairs = [(a, b) for a, b in itertools.combinations(sorted(full), 2) if full[a] != full[b]]
    return len(pairs), [(a, b, full[a] - full[b]) for a, b in pairs if (full[a] - full[b]) * (sub[a] - sub[b]) <= 0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="deep_bleu_2k", help="a folder of experiments/ with records")
    ap.add_argument("--sizes", default="100,200,400", help="subset sizes N, comma-separated")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes {args.sizes!r}: comma-separated integers >= 1 (e.g. 100,200,400)")
    root = ROOT / "experiments" / args.study
    if not (root / "test.ref.gz").is_file():
        ap.error(f"--study {args.study}: no {root.relative_to(ROOT)}/test.ref.gz (a study with records)")
    sys.path.insert(0, str(ROOT / "src"))
    import sacrebleu

    from normlab.evaluation import subset_rows

    refs = read_lines(root / "test.ref.gz")
    hyps = {d.name: h for d in sorted((root / "runs").iterdir()) if (d / "test.hyp.gz").is_file()
            and len(h := read_lines(d / "test.hyp.gz")) == len(refs)}

    def bleu(h: list[str], rows) -> float:
        rows = rows or range(len(refs))
        return sacrebleu.corpus_bleu([h[i] for i in rows], [[refs[i] for i in rows]]).score

    full = {k: bleu(h, None) for k, h in hyps.items()}
    print(f"{args.study}: {len(hyps)} runs' test outputs, {len(refs)} sentences")
    for n in sizes:
        rows = subset_rows(len(refs), n)
        sub = {k: bleu(h, rows) for k, h in hyps.items()}
        total, bad = swapped(full, sub)
        gaps = ", ".join(f"{a} / {b} {abs(d):.2f}" for a, b, d in sorted(bad, key=lambda x: abs(x[2])))
        shift = [sub[k] - full[k] for k in hyps]
        print(f"  N={n}: {total - len(bad)} of {total} pairs ordered as on the whole set; swapped (whole-set gap): "
              f"{gaps or 'none'}; subset - whole BLEU {min(shift):+.2f} to {max(shift):+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
