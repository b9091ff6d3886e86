"""Prune a trained model to fewer layers with each LayerDrop strategy and score every result.

    python -m normlab.commands.prune RUN_OR_CKPT                                  # all strategies, every depth
    python -m normlab.commands.prune RUN_OR_CKPT --strategies every_other --depths 3 --beam 1
    python -m normlab.commands.prune RUN_OR_CKPT --max-sentences 200 --out prune_small --force

For each strategy (every_other, search_on_valid, data_driven; regularizers/pruning.py) and each
kept depth r (layers kept per stack; the same r for encoder and decoder, capped at each stack's
depth), the model is pruned by module surgery and scored on the valid and test splits of the run's
data config (`.hydra/config.yaml` in the run folder, or --config): sacreBLEU (one code path with
training: normlab.evaluation) and the per-token NLL of the references (teacher forcing). A row for
the unpruned model comes first. search_on_valid ranks subsets by --search-metric on the valid
split (default: loss, i.e. −NLL, cheap; bleu decodes every candidate). data_driven needs a model
trained with regularizer.layerdrop_rates=learned; for other models its rows say "n/a".

Writes <out>/prune.{md,csv,json,png} (default out: <run>/prune) and each model's test
translations, <out>/hyps/<strategy>-r<r>.test.hyp (full.test.hyp: the unpruned model), in corpus
order, for significance tests; existing tables are only replaced with --force. --save-checkpoints also writes each pruned model as an ordinary checkpoint
(<out>/checkpoints/<strategy>-r<r>.ckpt) that load_model / translate / evaluate accept.
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

from normlab.checkpoint import atomic_write_bytes, save_model, write_json
from normlab.config import ConfigError
from normlab.commands.common import (CommandError, CommandParser, load, main_guard, parse_decoding_command,
                                     refuse_overwrite, run_dir_of_checkpoint)
from normlab.data.batching import batch_loader
from normlab.data.corpus import CorpusError
from normlab.evaluation import make_decoder, ordered, score, translate_batches
from normlab.regularizers.pruning import STRATEGIES, choose, learned_rates, prune

COLUMNS = ("strategy", "kept", "encoder_layers", "decoder_layers", "valid_bleu", "test_bleu",
           "valid_nll", "test_nll", "note")


class Split:
    """The first n sentences of a split: batches for decoding and for teacher-forced NLL, read from
    the data module's arrays (sources cut to the model's max_positions, as the data module does)."""

    def __init__(self, dm, split: str, n: int | None, max_tokens: int):
        ds = dm.datasets[split]
        n = len(ds) if n is None else min(n, len(ds))
        self.refs = dm.references(split)[:n]
        self.decode_batches = list(batch_loader(ds.head(n, sources_only=True), max_tokens))
        self.loss_batches = list(batch_loader(ds.head(n), max_tokens))

    @torch.no_grad()
    def nll(self, model) -> float:
        model.eval()
        device = next(model.parameters()).device
        total, ntok = 0.0, 0
        for b in self.loss_batches:
            logits = model(b["src"].to(device), b["tgt_in"].to(device))  # (B, T, V)
            tgt = b["tgt_out"].to(device)
            total += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=model.cfg.pad_id,
                                     reduction="sum").item()
            ntok += int(tgt.ne(model.cfg.pad_id).sum())
        return total / max(ntok, 1)

    def translate(self, model, decode, detok) -> list[str]:
        return ordered(translate_batches(model, self.decode_batches, decode, detok), len(self.refs))

    def bleu(self, model, decode, detok) -> dict:
        return score(self.translate(model, decode, detok), self.refs)


def _data_config(run_dir: Path, config: str | None) -> dict:
    path = Path(config) if config else run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise CommandError(f"{path} not found: the prune command reads the data config from the run "
                           "folder's .hydra/config.yaml; pass --config for another file")
    data = OmegaConf.to_container(OmegaConf.load(path).data, resolve=True)
    data.pop("_target_", None)
    return data


def _ints(text: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommandError(f"--depths={text!r} must be comma-separated integers") from None


def run_pruning(model, tok, splits: dict[str, Split], strategies: list[str], depths: list[int], decoder: dict,
                search_metric: str = "loss", max_exhaustive: int = 64, save_dir: Path | None = None,
                progress: bool = True, hyp_dir: Path | None = None) -> list[dict]:
    """One row per pruned model (and the full one). hyp_dir: each model's test translations are kept
    as <strategy>-r<kept>.test.hyp (full.test.hyp), for a paired bootstrap over sentences (normlab-study)."""
    decode = make_decoder(**decoder)
    n_enc, n_dec = len(model.encoder.layers), len(model.decoder.layers)

    def evaluate(m, tag: str) -> dict:
        out = {}
        for name, s in splits.items():
            hyps = s.translate(m, decode, tok.decode)
            out[f"{name}_bleu"] = score(hyps, s.refs)["bleu"]
            out[f"{name}_nll"] = round(s.nll(m), 4)
            if hyp_dir is not None and name == "test":
                text = "".join(h + "\n" for h in hyps).encode()
                atomic_write_bytes(hyp_dir / f"{tag}.test.hyp", lambda f: f.write(text))
        return out

    search_cache: dict[tuple, float] = {}

    def search_score(keep_enc: list[int], keep_dec: list[int]) -> float:
        key = (tuple(keep_enc), tuple(keep_dec))
        if key not in search_cache:
            m = prune(model, keep_enc, keep_dec)
            v = splits["valid"]
            search_cache[key] = (-v.nll(m) if search_metric == "loss" else v.bleu(m, decode, tok.decode)["bleu"])
        return search_cache[key]

    jobs = [(s, r) for s in strategies for r in depths if r < max(n_enc, n_dec)]
    bar = tqdm(total=len(jobs) + 1, unit="model", disable=not progress, file=sys.stderr)
    bar.set_description("full")
    rows = [{"strategy": "full", "kept": max(n_enc, n_dec), "encoder_layers": list(range(n_enc)),
             "decoder_layers": list(range(n_dec)), **evaluate(model, "full"), "note": ""}]
    bar.update()
    rates = learned_rates(model)
    for strategy, r in jobs:
        bar.set_description(f"{strategy} r={r}")
        r_enc, r_dec = min(r, n_enc), min(r, n_dec)
        row = {"strategy": strategy, "kept": r, "note": ""}
        if strategy == "data_driven" and rates is None:
            row.update(encoder_layers=None, decoder_layers=None, note="n/a: no learned rates")
        else:
            keep_enc, keep_dec = choose(strategy, model, r_enc, r_dec, search_score, max_exhaustive)
            pruned = prune(model, keep_enc, keep_dec)
            row.update(encoder_layers=keep_enc, decoder_layers=keep_dec, **evaluate(pruned, f"{strategy}-r{r}"))
            if save_dir is not None:
                save_model(save_dir / f"{strategy}-r{r}.ckpt", pruned, tok.proto,
                           pruned_from={"strategy": strategy, "encoder_layers": keep_enc, "decoder_layers": keep_dec})
        rows.append(row)
        bar.update()
    bar.close()
    return rows


def markdown(rows: list[dict], header: str = "") -> str:
    cols = ["strategy", "kept", "encoder_layers", "decoder_layers", "valid_bleu", "test_bleu", "valid_nll",
            "test_nll", "note"]
    fmt = lambda v: "" if v is None else (",".join(map(str, v)) if isinstance(v, list) else str(v))
    lines = ([header, ""] if header else []) + ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in r.items()})
    return buf.getvalue()


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    full = next(r for r in rows if r["strategy"] == "full")
    for ax, split in zip(axes, ("valid", "test")):
        for strategy in STRATEGIES:
            pts = sorted((r["kept"], r[f"{split}_bleu"]) for r in rows
                         if r["strategy"] == strategy and r.get(f"{split}_bleu") is not None)
            if pts:
                pts.append((full["kept"], full[f"{split}_bleu"]))
                ax.plot(*zip(*pts), marker="o", label=strategy)
        ax.axhline(full[f"{split}_bleu"], color="grey", ls="--", lw=0.8, label="unpruned")
        ax.set_title(f"{split}")
        ax.set_xlabel("kept layers per stack")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("BLEU (sacreBLEU)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, lambda f: f.write(buf.getvalue()))


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.prune", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("checkpoint", help="a checkpoint (.ckpt) or a run folder (its best, else last, checkpoint)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {', '.join(STRATEGIES)}")
    ap.add_argument("--depths", default=None, help="kept layers per stack, comma-separated (default: 1 .. N-1)")
    ap.add_argument("--out", help="output folder (default: <run>/prune)")
    ap.add_argument("--config", help="Hydra config with the data group (default: <run>/.hydra/config.yaml)")
    ap.add_argument("--max-sentences", type=int, default=None,
                    help="score only the first N sentences of valid and test (default: all)")
    ap.add_argument("--search-metric", choices=("loss", "bleu"), default="loss",
                    help="search_on_valid's criterion on the valid split (default: loss)")
    ap.add_argument("--max-exhaustive", type=int, default=64,
                    help="search_on_valid tries all C(N, r) subsets up to this many, else greedy (default: 64)")
    ap.add_argument("--save-checkpoints", action="store_true", help="write each pruned model as a checkpoint")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    args, decoder = parse_decoding_command(ap, argv, max_tokens=8192)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise CommandError("--strategies", f"{bad[0]!r} is not valid", STRATEGIES)
    if args.max_sentences is not None and args.max_sentences < 1:
        raise CommandError(f"--max-sentences={args.max_sentences} must be >= 1")

    model, tok, ckpt_path = load(args.checkpoint, args.device)
    run_dir = run_dir_of_checkpoint(ckpt_path)
    n = max(len(model.encoder.layers), len(model.decoder.layers))
    depths = _ints(args.depths) if args.depths else list(range(1, n))
    if not depths or depths[0] < 1:
        raise CommandError(f"--depths must be positive integers (the model has {n} layers per stack)")
    out = Path(args.out) if args.out else run_dir / "prune"
    files = {ext: out / f"prune.{ext}" for ext in ("md", "csv", "json", "png")}
    refuse_overwrite(*files.values(), force=args.force)
    save_dir = out / "checkpoints" if args.save_checkpoints else None
    if save_dir is not None:
        refuse_overwrite(*[save_dir / f"{s}-r{r}.ckpt" for s in strategies for r in depths], force=args.force)

    from normlab.data.datamodule import TranslationDataModule

    dm = TranslationDataModule(**{**_data_config(run_dir, args.config), "max_positions": model.cfg.max_positions},
                               tokenizer=tok, tokenizer_owner=str(ckpt_path))
    try:
        dm.setup("test")
    except (CorpusError, ConfigError) as e:
        raise CommandError(str(e)) from None
    splits = {s: Split(dm, s, args.max_sentences, args.max_tokens) for s in ("valid", "test")}
    rows = run_pruning(model, tok, splits, strategies, depths, decoder, args.search_metric, args.max_exhaustive,
                       save_dir, progress=not args.quiet, hyp_dir=out / "hyps")
    sig = score(["x"], ["x"])["bleu_signature"]
    meta = {"checkpoint": str(ckpt_path), "strategies": strategies, "depths": depths, "decoder": decoder,
            "search_metric": args.search_metric, "max_exhaustive": args.max_exhaustive,
            "sentences": {s: len(v.refs) for s, v in splits.items()}, "bleu_signature": sig,
            "learned_rates": learned_rates(model)}
    header = (f"Pruning {ckpt_path} ({len(splits['valid'].refs)} valid / {len(splits['test'].refs)} test sentences, "
              f"decoder {decoder}, search metric {args.search_metric}). BLEU: {sig}; nll: per reference token.")
    atomic_write_bytes(files["md"], lambda f: f.write(markdown(rows, header).encode()))
    atomic_write_bytes(files["csv"], lambda f: f.write(to_csv(rows).encode()))
    write_json(files["json"], {**meta, "rows": rows})
    plot(rows, files["png"], f"{ckpt_path.parent.parent.name}: BLEU vs kept layers")
    print(markdown(rows))
    print(f"-> {out}/prune.{{md,csv,json,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
