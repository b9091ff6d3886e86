"""A newcomer can navigate the docs (issue 37 item 9): a README of at most 320 lines that links
every docs/ page and shows each of the four jobs (one run, a sweep, a study, the W&B dashboard)
with an example and its page, and no relative link in the README or docs/ that leads nowhere
(a file that is not there, or an anchor no heading of that file makes). The examples themselves
run in tests/test_readme_examples.py."""
import re
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
# experiments/: the index, the studies' generated READMEs (study/readme.py) and the earlier studies' pages
EXPERIMENTS = sorted(p for p in (ROOT / "experiments").rglob("*.md") if "runs" not in p.relative_to(ROOT).parts)
JOBS = ("One run", "A sweep and its report", "A study", "The W&B dashboard")  # the README's four sections


def without_blocks(text: str) -> str:
    """The text with each fenced code block made as many empty lines (line numbers hold)."""
    return re.sub(r"^```.*?^```[^\n]*$", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a `[x](y)` is a link."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces -> `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_blocks(page.read_text(encoding="utf-8")), flags=re.M):
        base = slug(heading)
        out.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """`page:line: target (why)` for each relative link that leads nowhere."""
    out, root = [], root.resolve()
    for lineno, line in enumerate(prose(page.read_text(encoding="utf-8")).split("\n"), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path if path else page).resolve()
            where = f"{page.resolve().relative_to(root)}:{lineno}: {target}"
            if not dest.exists():
                out.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{where} (no heading {anchor!r} in {dest.relative_to(root)})")
    return out


def test_slug_is_githubs():
    # what github.com renders for headings of these pages (and the anchors their links used before the split)
    assert slug("Quick start (fresh clone, CPU)") == "quick-start-fresh-clone-cpu"
    assert slug("Weights & Biases") == "weights--biases"
    assert slug("Data pipeline (`data_pipeline.py`)") == "data-pipeline-data_pipelinepy"
    assert slug("Admin, divergence, stalls, diagnostics") == "admin-divergence-stalls-diagnostics"


def test_prose_keeps_line_numbers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("a\n```bash\nx [no](link.md)\n# not a heading\n```\n`[no](link.md)` [yes](gone.md)\n# H\n## H\n"
                    "### A `part.py` here\n")
    assert prose(page.read_text()).split("\n")[5] == " [yes](gone.md)"
    assert anchors(page) == {"h", "h-1", "a-partpy-here"}


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Sub part\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#sub-part) [ok](#top) [ok](https://x.org/#y)\n# Top\n"
                    "[gone](docs/b.md)\n[bad anchor](docs/a.md#sub)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page, tmp_path) == ["README.md:3: docs/b.md (no such file)",
                                            "README.md:4: docs/a.md#sub (no heading 'sub' in docs/a.md)"]


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 320, f"README.md has {lines} lines: move a section to a docs/ page (at most 320)"


def test_every_docs_page_is_linked_from_the_readme():
    assert len(PAGES) >= 10  # the topics of the former README, one page each
    targets = re.findall(r"\]\(([^)\s]+)\)", prose(README.read_text(encoding="utf-8")))
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in targets}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("job", JOBS)
def test_each_job_has_a_readme_section_with_an_example_and_its_page(job):
    text = README.read_text(encoding="utf-8")
    assert f"\n## {job}\n" in text, job
    section = text.split(f"\n## {job}\n", 1)[1].split("\n## ", 1)[0]
    assert "```bash\n" in section and re.search(r"\]\(docs/[\w-]+\.md(#[\w-]+)?\)", section), job


@pytest.mark.parametrize("page", [README, *PAGES, *EXPERIMENTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    # the index lists every study: one whose first run has not written its folder yet is linked ahead
    studies = {s.stem for s in (ROOT / "conf" / "study").glob("*.yaml")}

    def ahead(broken: str) -> bool:
        m = re.fullmatch(r"experiments/README\.md:\d+: (\w+)/ \(no such file\)", broken)
        return m is not None and m[1] in studies

    assert [b for b in broken_links(page) if not ahead(b)] == []


def readme_sections_cited(text: str) -> list[str]:
    """The sections of the root README a text names in words: `README, "Section"`, `README "Section"`
    or `README, Section)` (a paper's README, `the authors' README`, names no section)."""
    quoted = re.findall(r'(?<![\w/.])README(?:\.md)?,? "([^"]+)"', text)  # (benchmarks/README.md: another README)
    bare = re.findall(r"(?<![\w/.])README(?:\.md)?, ([A-Z][\w -]*?)[):;]", text)
    return quoted + bare


def test_readme_sections_cited_in_words_are_found():
    assert readme_sections_cited('see README, Determinism): x; (README "Studies: one, two") and '
                                 'README, "Runs that survive"; the authors\' README; dlcl README: 29.3; '
                                 '(benchmarks/README.md, "Hyper-connections")') == [
        "Studies: one, two", "Runs that survive", "Determinism"]


@pytest.mark.parametrize("page", [README, *PAGES, *EXPERIMENTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_sends_the_reader_to_a_readme_section_that_moved(page):
    """The README's sections moved to docs/ (issue 37 item 9): a page that still names one in words
    ("README, Determinism") names nothing; it links the docs/ page instead."""
    headings = set(re.findall(r"^#{1,6} (.+)$", without_blocks(README.read_text(encoding="utf-8")), flags=re.M))
    assert [c for c in readme_sections_cited(page.read_text(encoding="utf-8")) if c not in headings] == []


def test_a_study_readme_links_the_docs_from_where_it_is_written(tmp_path):
    """study/readme.docs_link: a relative link from experiments/<study>/ (or any folder of the
    checkout) that resolves to the section; plain text from outside the checkout."""
    from normlab.study.readme import docs_link

    for out in (ROOT / "experiments" / "twt_lowres", ROOT / "studies" / "x-smoke" / "experiment"):
        text = docs_link(out, "results-and-determinism.md", "Determinism")
        target = re.fullmatch(r"\[docs/results-and-determinism\.md, Determinism\]\((.+)\)", text)[1]
        path, _, anchor = target.partition("#")
        assert (out / path).resolve() == ROOT / "docs" / "results-and-determinism.md"
        assert anchor in anchors(ROOT / "docs" / "results-and-determinism.md")
    assert docs_link(tmp_path, "results-and-determinism.md", "Determinism") == (
        "docs/results-and-determinism.md, Determinism")


def test_what_the_code_cites_of_the_docs_is_there():
    """A comment or message naming `docs/<page>.md` (and `, "Section"`) names a page that exists and a
    section in it, so a later move cannot leave the code pointing at nothing."""
    files = [p for d in ("src", "conf", "tests", "benchmarks", "scripts", "sweeps") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".yaml", ".md", ".sh") and p.name != Path(__file__).name]
    files += [ROOT / "Makefile", ROOT / "pyproject.toml"]
    cited, bad = 0, []
    for f in files:
        for m in re.finditer(r'docs/([\w-]+\.md)(?:, \\?"([^"\\\n]+)\\?")?', f.read_text(encoding="utf-8")):
            cited += 1
            page = ROOT / "docs" / m[1]
            if not page.is_file() or (m[2] and m[2] not in page.read_text(encoding="utf-8")):
                bad.append(f"{f.relative_to(ROOT)}: {m[0]}")
    assert cited >= 10 and bad == []
