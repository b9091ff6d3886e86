"""Decoding speed: greedy and beam search, cached (incremental) vs uncached, in one run.

    python benchmarks/decoding.py                          # random-init default model (conf/model/tiny.yaml)
    python benchmarks/decoding.py --checkpoint RUN_OR_CKPT # a trained model
    python benchmarks/decoding.py --sentences 200 --beam 4 --threads 1 --json out.json

Decodes the first --sentences source lines of the bundled de-en test set, batched as evaluation
batches them (--max-tokens), and prints sentences/s, output tokens/s and the cached/uncached
ratio of each decoder. "Uncached" is the same beam search re-decoding the whole prefix at every
step (beam_search(incremental=False)); greedy is beam search with beam 1, and the production
greedy_decode is timed beside it. A random-init model rarely emits EOS, so every hypothesis runs
to max length (|src| + 50): the worst case for the uncached decoder's quadratic cost.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load(args):
    from normlab.checkpoint import load_model
    from normlab.config import ModelConfig
    from normlab.run_config import RUNTIME_MODEL_KEYS
    from normlab.data.datamodule import TranslationDataModule
    from normlab.model.transformer import Seq2SeqTransformer
    from omegaconf import OmegaConf

    if args.checkpoint:
        model, tok = load_model(args.checkpoint)
        return model, tok, f"trained checkpoint {args.checkpoint}"
    data = OmegaConf.load(ROOT / "conf" / "data" / "bible_de_en.yaml")
    dm = TranslationDataModule(**{k: str(ROOT / data[k]) for k in data if k.endswith(("_src", "_tgt"))},
                               vocab_size=data.vocab_size, cache_dir=str(ROOT / data.cache_dir), name=data.name)
    dm.prepare_data()  # the bundled corpus's preprocessed folder (built once, shared with training)
    tok = dm.folder.tokenizer
    m = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml"))
    m = {k: v for k, v in m.items() if k not in RUNTIME_MODEL_KEYS}
    torch.manual_seed(args.seed)
    cfg = ModelConfig(**m, vocab_size=tok.vocab_size, norm={"placement": "pre"})
    return Seq2SeqTransformer(cfg).eval(), tok, "random init, conf/model/tiny.yaml + norm=prenorm"


def timed(fn, batches) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = [hyp for src in batches for hyp in fn(src)]
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="trained checkpoint or run folder (default: random init)")
    ap.add_argument("--sentences", type=int, default=40)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--lenpen", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from normlab.data.corpus import read_lines
    from normlab.decoding.beam import beam_search
    from normlab.decoding.greedy import greedy_decode
    from normlab.evaluation import lines_loader

    model, tok, what = load(args)
    lines = read_lines(ROOT / "data" / "bible_de_en" / "test.de.gz")[: args.sentences]
    loader, _ = lines_loader(tok, lines, model.cfg.max_positions, args.max_tokens)
    batches = [b["src"] for b in loader]
    src_tokens = sum(int(b.ne(model.cfg.pad_id).sum()) for b in batches)

    def beam(k, incremental):
        return lambda src: [nb[0]["tokens"] for nb in beam_search(model, src, beam=k, lenpen=args.lenpen,
                                                                   incremental=incremental)]

    runs = {
        "greedy_decode (cached)": lambda src: greedy_decode(model, src),
        "beam 1 cached": beam(1, True),
        "beam 1 uncached": beam(1, False),
        f"beam {args.beam} cached": beam(args.beam, True),
        f"beam {args.beam} uncached": beam(args.beam, False),
    }
    print(f"model: {what}; {model.num_parameters():,} parameters; {len(lines)} sentences "
          f"({src_tokens} source tokens incl. EOS) in {len(batches)} batches; torch {torch.__version__}, "
          f"{args.threads} thread(s), {platform.processor() or platform.machine()}", flush=True)
    results, outputs = {}, {}
    for name, fn in runs.items():
        with torch.inference_mode():
            seconds, hyps = timed(fn, batches)
        n_tok = sum(len(h) for h in hyps)
        results[name] = {"seconds": round(seconds, 3), "sentences_per_s": round(len(hyps) / seconds, 2),
                         "tokens_per_s": round(n_tok / seconds, 1), "output_tokens": n_tok}
        outputs[name] = hyps
        print(f"{name:>24}: {seconds:8.2f} s  {len(hyps) / seconds:8.2f} sent/s  {n_tok / seconds:9.1f} tok/s"
              f"  ({n_tok} output tokens)", flush=True)
    k = args.beam
    ratios = {
        "greedy: cached / uncached speed": results["beam 1 uncached"]["seconds"] / results["beam 1 cached"]["seconds"],
        f"beam {k}: cached / uncached speed": results[f"beam {k} uncached"]["seconds"] / results[f"beam {k} cached"]["seconds"],
        f"greedy_decode / beam 1 speed": results["beam 1 cached"]["seconds"] / results["greedy_decode (cached)"]["seconds"],
        f"greedy / beam {k} speed": results[f"beam {k} cached"]["seconds"] / results["greedy_decode (cached)"]["seconds"],
    }
    for name, r in ratios.items():
        print(f"{name:>36}: {r:6.2f}x")
    same = {"greedy cached == uncached": outputs["beam 1 cached"] == outputs["beam 1 uncached"],
            "greedy_decode == beam 1": outputs["greedy_decode (cached)"] == outputs["beam 1 cached"],
            f"beam {k} cached == uncached": outputs[f"beam {k} cached"] == outputs[f"beam {k} uncached"]}
    print("identical outputs: " + ", ".join(f"{n}: {v}" for n, v in same.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": what, "sentences": len(lines), "threads": args.threads,
                                               "results": results, "ratios": ratios, "identical": same}, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
