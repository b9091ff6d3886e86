"""eval.valid_subset (issue 36): validation BLEU during training decodes a fixed subset of the valid
sentences, the same at every validation, while the validation loss and the final valid pass cover
the whole set; at null (or a size not below the set's) every pass is today's, bit for bit."""
from pathlib import Path

import pytest

import normlab.lit_module as lit
from normlab.evaluation import score, subset_rows
from normlab.train import run

from conftest import compose_cfg, tiny_overrides
from test_final_test import logged_validations

VALID = 40  # sentences in conftest.small_corpus's valid split


def test_the_subset_is_every_nth_sentence_of_the_file():
    assert subset_rows(10, 3) == (0, 3, 6)
    assert subset_rows(VALID, 10) == tuple(range(0, VALID, 4))
    rows = subset_rows(1000, 300)
    assert len(rows) == 300 and rows[0] == 0 and rows[-1] == 299 * 1000 // 300
    assert all(b > a for a, b in zip(rows, rows[1:]))  # distinct, in the file's order
    assert subset_rows(1000, 300) == rows  # a function of the sizes alone: every validation, every seed
    assert subset_rows(VALID, None) is None and subset_rows(VALID, VALID) is None and subset_rows(VALID, 10**6) is None


def _run(small_corpus, tmp_path, name: str, monkeypatch, *extra: str):
    """A tiny run; what it decoded: the sentence numbers of each translate_batches call, and every
    pass's (split, subset rows, hypotheses, result) as split_result saw it."""
    decoded: list[list[int]] = []
    passes: list[tuple] = []
    translate, split_result = lit.translate_batches, lit.Seq2SeqModule.split_result

    def counting(model, batches, decode, detok):
        out = translate(model, batches, decode, detok)
        decoded.append(sorted(out))
        return out

    def seen(self, split):
        metrics, result = split_result(self, split)
        passes.append((split, self._bleu_rows, dict(self._hyps), result))
        return metrics, result

    monkeypatch.setattr(lit, "translate_batches", counting)
    monkeypatch.setattr(lit.Seq2SeqModule, "split_result", seen)
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / name, tmp_path / "cache")
                      + ["eval.test=false", "eval.decoder.max_len_b=8", *extra])
    results = run(cfg)
    monkeypatch.undo()
    assert results["status"] == "completed"
    return results, decoded, passes


@pytest.fixture(scope="module")
def whole(small_corpus, tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        return _run(small_corpus, tmp_path_factory.mktemp("whole"), "run", m)


def test_a_small_subset_decodes_those_sentences_at_every_validation(whole, small_corpus, tmp_path, monkeypatch):
    results, decoded, passes = _run(small_corpus, tmp_path, "run", monkeypatch, "eval.valid_subset=10")
    rows = subset_rows(VALID, 10)
    validations = [p for p in passes if p[1] is not None]
    assert len(validations) == 2 and len(passes) == 3  # steps 4 and 8, then the final valid pass
    for split, bleu_rows, hyps, result in validations:
        assert bleu_rows == rows and sorted(hyps) == list(rows)  # the same 10 sentences each time
        assert result["subset"] == f"10 of {VALID} sentences"
        refs = [small_corpus_refs(small_corpus)[i] for i in rows]
        assert result["bleu"] == score([hyps[i] for i in rows], refs)["bleu"]  # each hypothesis with its reference
    assert sum(len(d) for d in decoded) == 2 * 10 + VALID  # no other sentence was decoded
    final = passes[-1]
    assert final[1] is None and sorted(final[2]) == list(range(VALID)) and "subset" not in final[3]
    assert results["valid_bleu"] == final[3]["bleu"]  # results.json: the whole set's
    # the loss of every validation is the whole set's: the run without a subset logged the same
    logged, logged_whole = logged_validations(tmp_path / "run"), logged_validations(_dir(whole))
    assert {s: v["valid/loss"] for s, v in logged.items()} == {s: v["valid/loss"] for s, v in logged_whole.items()}
    assert [logged[s]["valid/bleu"] for s in sorted(logged)] == pytest.approx([p[3]["bleu"] for p in validations])
    # the best checkpoint is chosen by the subset's BLEU (the first of a tie: a strict improvement)
    best = max(logged, key=lambda s: (logged[s]["valid/bleu"], -s))
    assert results["checkpoint"].endswith(f"best-step{best + 1}.ckpt")


def test_a_subset_of_the_whole_set_is_todays_pass_bit_for_bit(whole, small_corpus, tmp_path, monkeypatch):
    results, decoded, passes = _run(small_corpus, tmp_path, "run", monkeypatch, f"eval.valid_subset={VALID}")
    w_results, w_decoded, w_passes = whole
    assert decoded == w_decoded and [p[1] for p in passes] == [None] * 3
    assert [(p[0], p[2], p[3]) for p in passes] == [(p[0], p[2], p[3]) for p in w_passes]
    assert logged_validations(tmp_path / "run") == logged_validations(_dir(whole))
    keys = [k for k in w_results if k.startswith("valid_")]
    assert keys and {k: results[k] for k in keys} == {k: w_results[k] for k in keys}


def _dir(run) -> Path:
    return Path(run[0]["run_dir"])


def small_corpus_refs(small_corpus) -> list[str]:
    with open(small_corpus["valid_tgt"], encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.mark.parametrize("size", [15, 40])
def test_the_subset_is_sharded_over_ranks_as_the_whole_set_is(size, small_corpus, tmp_path):
    """Each of 2 ranks decodes its share of the subset's batches (equal counts, the odd one out a
    repeat), and together they decode the subset, each sentence in the batch the one process has it."""
    from types import SimpleNamespace

    from normlab.data.datamodule import TranslationDataModule

    dm = TranslationDataModule(**small_corpus, vocab_size=300, cache_dir=str(tmp_path), eval_max_tokens=512)
    dm.setup()
    rows = subset_rows(VALID, size) or tuple(range(VALID))
    alone = [b["idx"].tolist() for b in dm.dataloader("valid", rows=rows)]
    shards = []
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, current_epoch=0)
        shards.append([b["idx"].tolist() for b in dm.dataloader("valid", rows=rows)])
    assert len(alone) > 2 and len(shards[0]) == len(shards[1]) == (len(alone) + 1) // 2
    assert shards[0] + shards[1][:len(alone) // 2] == alone[0::2] + alone[1::2]  # every other batch, in turn
    assert sorted(i for b in alone for i in b) == list(rows)
