"""The README and docs/: short, every relative link resolving, the performance tables the
ones `benchmarks/report.py` builds from the newest results, and the docs' example the
test that runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    """The targets of `path`'s markdown links that are files of this repository (no
    scheme, no pure anchor), without their anchors."""
    targets = [t.split("#")[0] for t in LINK.findall(path.read_text())]
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    missing = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert missing == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    """The control: a link to a file that does not exist is reported."""
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) and [gone](docs/nowhere.md#part)\n")
    assert [t for t in relative_links(page) if not (tmp_path / t).exists()] == ["docs/nowhere.md"]


@pytest.mark.parametrize("target", sorted(report.TARGETS))
def test_the_performance_tables_are_the_generated_ones(target):
    """README.md's and docs/performance.md's tables equal what `python benchmarks/report.py`
    builds from the newest results files; `--write` puts them there."""
    text = (ROOT / target).read_text()
    names = [m[2] for m in report.MARKER.finditer(text)]
    assert sorted(names) == sorted(report.TARGETS[target])
    assert text == report.render(text, report.tables())


def test_a_newer_results_file_changes_the_table(tmp_path):
    """The control: the newest results with both peers is the one the table shows."""
    newest = report.newest_gguf_peers()
    assert newest is not None
    older = tmp_path / "older.json"
    text = newest.read_text()
    older.write_text(text.replace("utc 20", "utc 19", 1))
    (tmp_path / "newer.json").write_text(text.replace("utc 20", "utc 21", 1))
    assert report.newest_gguf_peers(tmp_path).name == "newer.json"


def test_sittings_take_the_median_of_each_sittings_median(tmp_path):
    """`report.py --sittings`: per file and peer, the median over sittings of each
    sitting's median ratio (issue 59's median of medians), not of their ranges."""
    newest = json.loads(report.newest_gguf_peers().read_text())
    paths = []
    for i, ratio in enumerate((1.5, 0.5, 1.2)):
        rows = [dict(r) for r in newest["rows"]]
        for r in rows:
            if r.get("engine") == "compilecore greedy" and "vs ik_llama.cpp, median (range)" in r:
                r["vs ik_llama.cpp, median (range)"] = f"{ratio} (0.1-9.9)"
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps({**newest, "rows": rows}))
    lines = report.sittings_table(paths)
    header = [c.strip() for c in lines[2].split("|")]
    column = header.index("decode vs ik_llama.cpp")
    files = [line for line in lines[4:] if line.startswith("| ")]
    assert files and all(line.split("|")[column].strip() == "1.20" for line in files)


def test_the_docs_example_is_the_test_that_runs_it():
    """docs/passes.md shows tests/test_testing_kit.py's property test as written there."""
    test = (ROOT / "tests" / "test_testing_kit.py").read_text()
    example = test.split("# --- docs example start ---\n")[1].split("# --- docs example end ---")[0]
    assert example.strip() in (ROOT / "docs" / "passes.md").read_text()
