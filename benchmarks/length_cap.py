"""What a shorter length cap saves on a model that never stops, and what it could cut of a good one.

    python benchmarks/length_cap.py                      # 1,000 test sentences, greedy and beam 4 (~15 min)
    python benchmarks/length_cap.py --sentences 100      # check the script (about a minute)

Both decoders stop a hypothesis at max_len_a * |src| + max_len_b tokens (|src|: source tokens and EOS).
The default is the papers' |src| + 50 (Vaswani et al. 2017); fairseq's generate has --max-len-a and
--max-len-b, and `--max-len-a 1.2 --max-len-b 10` is the usual setting for translation. A model at
its input-independent floor, or one early in training, seldom emits EOS and decodes every sentence
to the cap, so the cap sets its decode time. This script

- counts, on the bundled corpus's valid and test splits, the references longer than each cap (a
  hypothesis of a model that translates as the reference does would be cut there: what the cap
  could cost a good model's BLEU);
- times greedy and beam 4 with each cap, taking turns batch by batch, on a random-init model of
  deep_bleu's shape (12+12, d 64, post-LN: stalled_scoring.py's model), whose hypotheses run to
  the cap (the share is printed), 1 thread as a study job has.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stalled_scoring import ROOT, batches, setup  # noqa: E402

CAPS = {"|src| + 50": (1.0, 50), "1.2 |src| + 10": (1.2, 10)}  # name: (max_len_a, max_len_b)


def cap_of(src_len: torch.Tensor, a: float, b: int, max_positions: int) -> torch.Tensor:
    """The decoders' cap (decoding.beam.max_lengths) for sources of src_len tokens with EOS."""
    return (src_len.float() * a + b).long().clamp(min=1, max=max_positions - 1)


def coverage(dm, max_positions: int) -> dict[str, dict[str, float]]:
    """{split: {cap: [references (target tokens) longer than the cap, references, the least room
    left under the cap]}}."""
    out = {}
    for split in ("valid", "test"):
        ds = dm.datasets[split]
        src = torch.from_numpy(ds.src_sizes.astype("int64"))  # source + EOS, as decoded
        tgt = torch.from_numpy(ds.tgt_sizes.astype("int64")) - 1  # the reference's tokens (BOS off)
        out[split] = {}
        for name, (a, b) in CAPS.items():
            room = cap_of(src, a, b, max_positions) - tgt
            out[split][name] = [int((room < 0).sum()), len(tgt), int(room.min())]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=1000, help="about this many test sentences (of 1,000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from normlab.evaluation import make_decoder

    dm, model = setup(args)
    pad, max_pos = model.cfg.pad_id, model.cfg.max_positions
    cover = coverage(dm, max_pos)
    for split, shares in cover.items():
        print(f"{split}: references longer than the cap: " + ", ".join(
            f"{k} {cut} of {n} (least room under it: {room} tokens)" for k, (cut, n, room) in shares.items()))
    test = batches(dm.test_dataloader(), args.sentences)
    seconds = {(beam, cap): 0.0 for beam in (1, 4) for cap in CAPS}
    at_cap = {key: [] for key in seconds}
    with torch.inference_mode():
        for b in test:  # taking turns, batch by batch
            src_len = b["src"].ne(pad).sum(1)
            for beam, cap in seconds:
                a, m = CAPS[cap]
                t0 = time.perf_counter()
                hyps = make_decoder(beam=beam, max_len_a=a, max_len_b=m)(model, b["src"])
                seconds[beam, cap] += time.perf_counter() - t0
                at_cap[beam, cap] += [len(h) >= int(c) for h, c in zip(hyps, cap_of(src_len, a, m, max_pos))]
    n = sum(len(b["idx"]) for b in test)
    print(f"model: 12+12, d 64, post-LN, random init; {n} test sentences in {len(test)} batches; "
          f"{args.threads} thread(s); torch {torch.__version__}")
    rows = {}
    for beam in (1, 4):
        base = seconds[beam, "|src| + 50"]
        for cap in CAPS:
            share = sum(at_cap[beam, cap]) / max(len(at_cap[beam, cap]), 1)
            rows[f"beam{beam} {cap}"] = {"s": seconds[beam, cap], "ratio": seconds[beam, cap] / base, "at_cap": share}
            print(f"{'greedy' if beam == 1 else 'beam 4':>6}, cap {cap:<14}: {seconds[beam, cap]:7.1f} s  "
                  f"({seconds[beam, cap] / base:.3f} of |src| + 50; {share:.0%} of hypotheses at the cap)")
    if args.json:
        Path(args.json).write_text(json.dumps({"sentences": n, "threads": args.threads, "coverage": cover,
                                               "decode": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
