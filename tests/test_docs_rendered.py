"""The docs' rendered result tables agree with their records (scripts/render_results.py)."""
import json
import re
from pathlib import Path

import pytest

from mergecomp_bench import results
from mergecomp_bench.results import data

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_rendered_table_is_what_its_records_give(path):
    stale = results.render_file(path, check=True)
    assert not stale, (f"{path.name}: {stale} differ from their records in docs/img/data; "
                       f"run python scripts/render_results.py")


def test_the_docs_hold_every_table():
    text = "".join(path.read_text() for path in DOCS)
    assert all(f"<!-- rendered: {name} -->" in text for name in results.TABLES)


def test_a_table_edited_by_hand_is_found_and_rendered_back(tmp_path):
    doc = tmp_path / "doc.md"
    table = results.TABLES["own-work"]()
    edited = table.replace("1.00x", "9.99x", 1)  # the anchor's own ratio, in every record
    doc.write_text(f"intro\n\n<!-- rendered: own-work -->\n{edited}<!-- end rendered -->\n\nafter\n")
    assert results.render_file(doc, check=True) == ["own-work"]
    assert "9.99x" in doc.read_text()  # check writes nothing
    assert results.render_file(doc) == ["own-work"]
    assert doc.read_text() == f"intro\n\n<!-- rendered: own-work -->\n{table}<!-- end rendered -->\n\nafter\n"
    assert results.render_file(doc, check=True) == []


def test_a_missing_record_or_table_is_named(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- rendered: no-such-table -->\n<!-- end rendered -->\n")
    with pytest.raises(LookupError, match="no-such-table"):
        results.render_file(doc)
    monkeypatch.setattr(data, "DATA", tmp_path)
    with pytest.raises(LookupError, match="host_overhead_cpu.jsonl"):
        results.own_work()
    run = {"config": "ddp-fp16", "seed": 3, "status": "ok", "curve": [], "step_s": 0.1, "compute_s": 0.05,
           "final_test_loss": 2.0}
    (tmp_path / "tta.jsonl").write_text(json.dumps(run) + "\n")
    with pytest.raises(LookupError, match="tta.jsonl: no DDP fp32 run for seed 3"):
        results.time_to_accuracy("tta.jsonl", {})


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_reaches_its_file_and_heading():
    headings = {}
    for path in DOCS:
        prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        headings[path.resolve()] = {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", prose, re.M)}
    broken = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            linked = (path.parent / target).resolve() if target else path.resolve()
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in headings.get(linked, ()):
                broken.append(f"{path.name}: {target}#{anchor}")
    assert not broken, f"links to nothing: {broken}"
