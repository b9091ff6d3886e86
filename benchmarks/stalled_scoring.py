"""What the test pass of a stalled run costs: decoding (before) vs its loss only (after), in one run.

    python benchmarks/stalled_scoring.py                       # deep_bleu's post-LN (12+12, d 64), the whole test split
    python benchmarks/stalled_scoring.py --sentences 20        # one batch (~270 sentences)

A stalled run (callbacks/stall.py) used to be scored like any other: its test set decoded with beam 4
to the length cap (|src| + 50) or until 4 hypotheses ended, which for a model at its input-independent
floor took minutes (deep_bleu's stalled post-LN seed 2: ~252 s of its 1,146 s) for a BLEU of 0. Now
its test pass scores the teacher-forced loss only (final_test.py), as do its valid passes and the
validations while a stall is held (benchmarks/stalled_arm.py times the whole arm). This script times
the test pass both ways, taking
turns on the same batches (spread over the split's length order: evaluation batches are sorted by
length), on a random-init model of deep_bleu's post-LN shape, whose hypotheses run to the cap (the
share is printed), 1 thread as a study job has. "Before" is the loss and the decode, as the old pass
did both. The arm's cost then follows from a committed record (--record, --record-test-s).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "experiments" / "deep_bleu_2k" / "runs" / "post_ln-s2" / "results.json"


def setup(args):
    from normlab.config import ModelConfig
    from normlab.data.datamodule import TranslationDataModule
    from normlab.model.transformer import Seq2SeqTransformer
    from omegaconf import OmegaConf

    data = OmegaConf.load(ROOT / "conf" / "data" / "bible_de_en.yaml")
    dm = TranslationDataModule(**{k: str(ROOT / data[k]) for k in data if k.endswith(("_src", "_tgt"))},
                               vocab_size=data.vocab_size, cache_dir=str(ROOT / data.cache_dir), name=data.name,
                               max_tokens=data.max_tokens, eval_max_tokens=data.eval_max_tokens)  # the runs' batches
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(args.seed)
    # deep_bleu's common settings with its post_ln arm (conf/study/deep_bleu.yaml)
    cfg = ModelConfig(vocab_size=dm.tokenizer.vocab_size, d_model=64, encoder_ffn=256, decoder_ffn=256,
                      encoder_layers=12, decoder_layers=12, norm={"placement": "post"})
    return dm, Seq2SeqTransformer(cfg).eval()


def batches(loader, n: int) -> list[dict]:
    """Evenly spaced batches of the split (sorted by length) holding about n sentences."""
    every = list(loader)
    per = max(1, round(len(every) * min(1.0, n / max(1, sum(len(b["idx"]) for b in every)))))
    step = len(every) / per
    return [every[int(i * step)] for i in range(per)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=1000, help="about this many test sentences (of 1,000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--record", default=str(RECORD), help="a stalled run's committed results.json")
    ap.add_argument("--record-test-s", type=float, default=252.0,
                    help="seconds the record's run spent in its beam-4 test pass (its train.log)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from normlab.evaluation import make_decoder
    from normlab.losses import model_loss

    dm, model = setup(args)
    pad = model.cfg.pad_id
    test, beam4 = batches(dm.test_dataloader(), args.sentences), make_decoder(beam=4)

    def loss(b):
        return model_loss(model, b["src"], b["tgt_in"], b["tgt_out"], 0.1, pad)[0].item()

    seconds = {"before": 0.0, "after": 0.0}
    hyps, cap = [], []
    with torch.inference_mode():
        for b in test:  # taking turns, batch by batch
            t0 = time.perf_counter()
            loss(b)
            out = beam4(model, b["src"])
            t1 = time.perf_counter()
            loss(b)
            t2 = time.perf_counter()
            seconds["before"] += t1 - t0
            seconds["after"] += t2 - t1
            hyps += out
            cap += [min(int(n) + 50, model.cfg.max_positions - 1) for n in b["src"].ne(pad).sum(1)]
    at_cap = sum(len(h) >= c - 1 for h, c in zip(hyps, cap)) / max(len(hyps), 1)
    ratio = seconds["after"] / seconds["before"]
    print(f"model: 12+12, d 64, post-LN, random init ({model.num_parameters():,} parameters); {len(hyps)} test "
          f"sentences in {len(test)} batches; {args.threads} thread(s); torch {torch.__version__}; {at_cap:.0%} of "
          f"the hypotheses reach the length cap")
    print(f"test pass: before (loss + beam 4) {seconds['before']:.1f} s, after (loss only) {seconds['after']:.1f} s: "
          f"after / before = {ratio:.3f}")
    out = {"sentences": len(hyps), "threads": args.threads, "at_cap": at_cap, **{f"{k}_s": v for k, v in seconds.items()},
           "ratio": ratio}
    rec = Path(args.record)
    if rec.is_file():
        res = json.loads(rec.read_text())
        wall = float(res["wall_s"])
        est = wall - args.record_test_s * (1 - ratio)
        print(f"{rec.relative_to(ROOT) if rec.is_relative_to(ROOT) else rec}: {res['status']} at step "
              f"{res.get('stopped_at_step')}, {wall:.0f} s; its test pass {args.record_test_s:.0f} s -> "
              f"{args.record_test_s * ratio:.0f} s: the arm costs ~{est:.0f} s now")
        out.update(record=str(rec), record_wall_s=wall, record_test_s=args.record_test_s, estimated_wall_s=est)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
