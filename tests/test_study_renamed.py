"""A study renamed when a new regime took its name (twt_lowres -> twt_lowres_2k, issue 35) keeps its
records, trained in W&B group study-<its former name>, a group the new study of that name uses too
(a W&B run cannot be regrouped). Its file names the former name (`formerly:`), so its own records
count as trained there when another study's copy of the same run exists (runner.shared_index), its
README and the index say which W&B group holds its runs (its new runs go to its current name's:
their labels name the study), and `report` / `normlab-runs` name the study that holds a record by
its current name. Identities are unchanged (the runs are found as before: tests/test_study_split.py)."""
import json
import shutil
from pathlib import Path

import pytest

from normlab.commands import runs as runs_cmd
from normlab.commands.common import main_guard
from normlab.commands.report_runs import find_runs, key_of
from normlab.errors import UserError
from normlab.study.runner import shared_index
from normlab.study.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
# each study kept with its records under a new name -> the name its runs trained under
RENAMED = {"deep_bleu_2k": "deep_bleu", "deep_recent_2k": "deep_recent", "drophead_4k": "drophead",
           "layerdrop_prune_2k": "layerdrop_prune", "layerdrop_prune_4k": "layerdrop_prune",
           "twt_lowres_2k": "twt_lowres", "twt_scalenorm_2k": "twt_scalenorm"}


def record(root: Path, folder_study: str, rec: str, **res) -> Path:
    folder = root / folder_study / "runs" / rec
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"status": "completed", "seed": 1, **res}))
    return folder


def test_a_renamed_studys_own_record_wins_over_another_studys_copy(tmp_path):
    """twt_lowres_2k trained the run as twt_lowres (group study-twt_lowres); layerdrop_prune_2k wrote
    its own record of the same run from the finished run folder (no `shared_from`, the trainer's
    group). The index points at the study that trained it (was: layerdrop_prune_2k's copy, the first
    found, since neither group was its folder's study-<name>)."""
    root = tmp_path / "experiments"
    trained = record(root, "twt_lowres_2k", "pre_ln-s1", identity_hash="abc12345", group="study-twt_lowres",
                     study={"name": "twt_lowres", "arm": "pre_ln", "seed": 1})
    record(root, "layerdrop_prune_2k", "scratch3-s1", identity_hash="abc12345", group="study-twt_lowres",
           study={"name": "layerdrop_prune", "arm": "scratch3", "seed": 1})
    # layerdrop_prune_2k's own run, trained as layerdrop_prune: trained there, not taken by a copy sorted first
    own = record(root, "layerdrop_prune_2k", "ld0-s1", identity_hash="def67890", group="study-layerdrop_prune",
                 study={"name": "layerdrop_prune", "arm": "ld0", "seed": 1})
    record(root, "drophead_4k", "x-s1", identity_hash="def67890", group="study-layerdrop_prune",
           study={"name": "drophead", "arm": "x", "seed": 1})
    index = shared_index(root)
    assert index["abc12345"] == trained
    assert index["def67890"] == own


def test_the_committed_records_point_at_the_study_that_trained_each_run():
    """Over experiments/: the record the index gives for a run is one whose group is the study-<name>
    of the study that wrote it (was: twt_lowres_2k's pre-LN runs 1596a043 and a1286910 pointed at
    layerdrop_prune_2k's copies, trained as twt_lowres)."""
    root = ROOT / "experiments"
    index = shared_index(root)
    trained = {}
    for path in root.glob("*/runs/*/results.json"):
        res = json.loads(path.read_text())
        if res.get("group") == f"study-{(res.get('study') or {}).get('name')}" and not res.get("shared_from"):
            trained.setdefault(res["identity_hash"], set()).add(path.parent)
    assert len(trained) > 80
    wrong = {h: str(index[h].relative_to(root)) for h, found in trained.items() if index[h] not in found}
    assert wrong == {}
    assert index["1596a043"] == root / "twt_lowres_2k" / "runs" / "pre_ln-s1"


def test_each_renamed_study_names_the_group_its_records_are_in():
    """Every study whose records carry another name's group declares that name (`formerly:`), and the
    groups of its records are its own name's, its former name's, or a study's it shares runs with
    (shared_from, or a run folder that study trained)."""
    for name, former in RENAMED.items():
        assert load_study(name).formerly == (former,), name
    assert load_study("twt_lowres").formerly == ()
    for path in (ROOT / "experiments").glob("*/runs/*/results.json"):
        res, study = json.loads(path.read_text()), path.parents[2].name
        if not str(res.get("group") or "").startswith("study-") or res.get("shared_from"):
            continue
        if res["group"] != f"study-{study}":  # its former name's, or trained as another study (a copy)
            assert res["group"] == f"study-{RENAMED.get(study)}" or res["group"] != f"study-{res['study']['name']}", path


def test_formerly_must_be_a_list_of_other_names(tmp_path):
    text = (ROOT / "conf" / "study" / "twt_lowres_2k.yaml").read_text()
    for bad in ("formerly: twt_lowres", "formerly: [twt_lowres_2k]", "formerly: [1]", "formerly: 0",
                "formerly: ''", "formerly: false", "formerly: [twt_lowres, twt_lowres]"):
        path = tmp_path / "twt_lowres_2k.yaml"
        path.write_text(text.replace("formerly: [twt_lowres]", bad))
        with pytest.raises(UserError, match="formerly"):
            load_study(str(path))


def committed(tmp_path, name: str) -> Path:
    out = tmp_path / "experiments" / name
    shutil.copytree(ROOT / "experiments" / name / "runs", out / "runs")
    return out


def test_the_readme_and_the_index_name_the_w_and_b_group_of_a_renamed_studys_runs(tmp_path):
    """twt_lowres_2k's README says its runs are in study-twt_lowres, the group the study twt_lowres now
    runs in too, and that its new runs go to study-twt_lowres_2k; layerdrop_prune_2k's also names the
    runs it holds that trained as twt_lowres; the index lists both (was: no word of the groups)."""
    from normlab.study.claims import judge
    from normlab.study.index import update_index
    from normlab.study.readme import write_study
    from normlab.study.records import load_records

    for name in ("twt_lowres_2k", "layerdrop_prune_2k"):
        study, out = load_study(name), committed(tmp_path, name)
        by_arm = load_records(out)
        write_study(study, by_arm, judge(study, by_arm, None), out, f"normlab-study {name}")
    text = (tmp_path / "experiments" / "twt_lowres_2k" / "README.md").read_text()
    assert ("W&B groups of its runs (the group a run trained in; W&B cannot regroup a run): `study-twt_lowres` "
            "(8 runs, trained under this study's former name twt_lowres; the study twt_lowres now runs in this "
            "group too") in text
    assert "New runs of this study go to `study-twt_lowres_2k`." in text
    claims = json.loads((tmp_path / "experiments" / "twt_lowres_2k" / "claims.json").read_text())
    assert claims["cost"]["groups"] == {"study-twt_lowres": 8} and claims["formerly"] == ["twt_lowres"]
    text = (tmp_path / "experiments" / "layerdrop_prune_2k" / "README.md").read_text()
    assert "`study-layerdrop_prune` (6 runs, trained under this study's former name layerdrop_prune;" in text
    assert "`study-twt_lowres` (2 runs, trained as twt_lowres: runs it shares)" in text
    index = tmp_path / "experiments" / "README.md"
    update_index(index)
    index_text = index.read_text()
    assert "## W&B groups" in index_text
    assert "- [twt_lowres_2k](twt_lowres_2k/): W&B groups of its runs" in index_text
    assert "- [layerdrop_prune_2k](layerdrop_prune_2k/): W&B groups of its runs" in index_text
    # a study whose runs are all in its own group: nothing to say
    from normlab.study.wandb_groups import group_text

    assert group_text("twt_lowres", "full", {"study-twt_lowres": 6}) == ""
    assert group_text("twt_lowres", "full", {}) == ""


def test_report_and_runs_name_a_record_by_the_study_that_holds_it_now(tmp_path, capsys):
    """A twt_lowres_2k record says study.name twt_lowres (the name when it was written, now another
    study's): `report --rows study` and `normlab-runs` show twt_lowres_2k (was: twt_lowres, mixing the
    two regimes in one row)."""
    out = committed(tmp_path, "twt_lowres_2k")
    runs = find_runs([str(out / "runs")])
    assert len(runs) == 8 and {key_of(r, ["study"]) for r in runs} == {("twt_lowres_2k",)}
    assert main_guard(runs_cmd.main, [str(tmp_path / "experiments"), "--json"]) == 0
    assert {r["study"] for r in json.loads(capsys.readouterr().out)} == {"twt_lowres_2k"}


def test_a_smoke_budgets_former_group_and_a_formerly_string_read_leniently():
    """Another budget's groups carry its suffix (study-twt_lowres-smoke): still the former name's runs
    (was: "trained as twt_lowres-smoke: runs it shares"); own_groups' lenient read takes a string as no
    names (was: its letters, study-t, study-w, ...)."""
    from normlab.study.spec import former_names
    from normlab.study.wandb_groups import group_text

    text = group_text("twt_lowres_2k", "smoke", {"study-twt_lowres-smoke": 2}, ("twt_lowres",))
    assert "`study-twt_lowres-smoke` (2 runs, trained under this study's former name twt_lowres;" in text
    assert text.endswith("New runs of this study go to `study-twt_lowres_2k-smoke`.")
    assert former_names("twt_lowres") == () and former_names(["twt_lowres", 3]) == ("twt_lowres",)


def test_a_record_named_from_inside_its_folder_is_its_folders_study(tmp_path, monkeypatch):
    """`normlab-runs .` inside experiments/<study>/runs/<arm>-s<seed>: the folder's study (was: Path('.')
    has no name, so the name the record was written under)."""
    from normlab.study.records import holding_study

    record = tmp_path / "twt_lowres_2k" / "runs" / "pre_ln-s1"
    record.mkdir(parents=True)
    monkeypatch.chdir(record)
    assert holding_study(Path("."), {"study": {"name": "twt_lowres", "arm": "pre_ln", "seed": 1}}) == "twt_lowres_2k"
