"""What scoring a stalled run costs: decoding (before) vs its loss only (after), in one run.

    python benchmarks/stalled_scoring.py                       # deep_bleu's post-LN (12+12, d 64), 200 sentences
    python benchmarks/stalled_scoring.py --sentences 1000      # whole splits
    python benchmarks/stalled_scoring.py --sentences 20        # check the script (seconds)

A stalled run's model sits at its input-independent floor: it never emits EOS, so every sentence
decodes to the length cap (|src| + 50), like the random-init model measured here (the script prints
the share of hypotheses that reach the cap). Until issue 21 a stalled run stopped early was scored by
three decoding passes: the validation Lightning runs at the stop (greedy, valid split), the final
re-validation (greedy, valid) and the beam-4 test; now all three score the teacher-forced loss only
(Seq2SeqModule.decoder, final_test.py). Both ways on the same batches, taking turns; 1 thread, as a
study job has. The arm's cost then follows from a committed record (--record): its wall time minus
the passes' share, scaled by the measured ratio (the record's passes are given in seconds, from its
run's train.log, with --record-passes).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "experiments" / "deep_bleu" / "runs" / "post_ln-s2" / "results.json"


def setup(args):
    from normlab.config import ModelConfig
    from normlab.data.datamodule import TranslationDataModule
    from normlab.model.transformer import Seq2SeqTransformer
    from omegaconf import OmegaConf

    data = OmegaConf.load(ROOT / "conf" / "data" / "bible_de_en.yaml")
    dm = TranslationDataModule(**{k: str(ROOT / data[k]) for k in data if k.endswith(("_src", "_tgt"))},
                               vocab_size=data.vocab_size, cache_dir=str(ROOT / data.cache_dir), name=data.name)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(args.seed)
    # deep_bleu's common settings with its post_ln arm (conf/study/deep_bleu.yaml)
    cfg = ModelConfig(vocab_size=dm.tokenizer.vocab_size, d_model=64, encoder_ffn=256, decoder_ffn=256,
                      encoder_layers=12, decoder_layers=12, norm={"placement": "post"})
    return dm, Seq2SeqTransformer(cfg).eval()


def batches(loader, n: int) -> list[dict]:
    out, seen = [], 0
    for b in loader:
        if seen >= n:
            break
        out.append(b)
        seen += len(b["idx"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=200, help="per split (the splits have 1,000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--record", default=str(RECORD), help="a stalled run's committed results.json")
    ap.add_argument("--record-passes", type=float, default=472.0,
                    help="seconds the record's run spent in its three decoding passes (its train.log: "
                         "~150 s validation at the stop, 70 s final valid, 252 s beam test)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from normlab.evaluation import make_decoder
    from normlab.losses import model_loss

    dm, model = setup(args)
    pad = model.cfg.pad_id
    valid, test = batches(dm.val_dataloader(), args.sentences), batches(dm.test_dataloader(), args.sentences)
    greedy, beam4 = make_decoder(beam=1), make_decoder(beam=4)

    def decode(bs, dec):
        return [h for b in bs for h in dec(model, b["src"])]

    def loss(bs):
        return [model_loss(model, b["src"], b["tgt_in"], b["tgt_out"], 0.1, pad)[0].item() for b in bs]

    passes = {  # the stalled run's three passes, each way
        "before": [("valid at the stop, greedy", lambda: decode(valid, greedy)),
                   ("final valid, greedy", lambda: decode(valid, greedy)),
                   ("final test, beam 4", lambda: decode(test, beam4))],
        "after": [("valid at the stop, loss", lambda: loss(valid)),
                  ("final valid, loss", lambda: loss(valid)),
                  ("final test, loss", lambda: loss(test))],
    }
    seconds: dict[str, list[float]] = {"before": [], "after": []}
    capped = []
    with torch.inference_mode():
        for (_, b), (_, a) in zip(*passes.values()):  # taking turns, pass by pass
            for way, fn in (("before", b), ("after", a)):
                t0 = time.perf_counter()
                out = fn()
                seconds[way].append(time.perf_counter() - t0)
                if way == "before":
                    capped.append(out)
    srcs = [b["src"] for b in valid] * 2 + [b["src"] for b in test]
    lens = [int(n) for s in srcs for n in s.ne(pad).sum(1)]
    hyps = [h for out in capped for h in out]
    at_cap = sum(len(h) >= n + 49 for h, n in zip(hyps, lens)) / max(len(hyps), 1)
    n_sent = len(lens) // 3
    before, after = sum(seconds["before"]), sum(seconds["after"])
    ratio = after / before
    print(f"model: 12+12, d 64, post-LN, random init ({model.num_parameters():,} parameters); {n_sent} sentences "
          f"per pass; {args.threads} thread(s); torch {torch.__version__}; {at_cap:.0%} of the decoded "
          f"hypotheses reach the length cap")
    for (name_b, _), (name_a, _), sb, sa in zip(passes["before"], passes["after"], seconds["before"], seconds["after"]):
        print(f"  {name_b:>28}: {sb:7.2f} s   {name_a:>26}: {sa:6.2f} s")
    print(f"three passes: before {before:.1f} s, after {after:.1f} s: after / before = {ratio:.3f}")
    out = {"sentences": n_sent, "threads": args.threads, "at_cap": at_cap, "before_s": seconds["before"],
           "after_s": seconds["after"], "ratio": ratio}
    rec = Path(args.record)
    if rec.is_file():
        res = json.loads(rec.read_text())
        wall = float(res["wall_s"])
        est = wall - args.record_passes * (1 - ratio)
        print(f"{rec.relative_to(ROOT) if rec.is_relative_to(ROOT) else rec}: {res['status']} at step "
              f"{res.get('stopped_at_step')}, {wall:.0f} s; its decoding passes {args.record_passes:.0f} s -> "
              f"{args.record_passes * ratio:.0f} s: the arm costs ~{est:.0f} s now")
        out.update(record=str(rec), record_wall_s=wall, record_passes_s=args.record_passes, estimated_wall_s=est)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
