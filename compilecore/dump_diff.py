"""Comparing two compile dumps: what a pass changed, what a torch upgrade changed.

Files are paired by their path inside the dump and compared after normalizing what
differs without meaning (addresses, generated names and counters, hashes, paths, line
numbers). Op-count deltas per piece come from the dumps' report.json.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_NORMALIZERS = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"__(compiled_fn|resume_at|transformed_code)_\w+"), r"__\1_N"),
    (re.compile(r"\b[a-z0-9]{20,}\b"), "<hash>"),  # Inductor cache keys and kernel files
    (re.compile(r"(?<![\w.])/[\w./+-]+"), "<path>"),
    (re.compile(r"\bline \d+"), "line N"),
    (re.compile(r"\['\d+_inference'\]"), "['N_inference']"),
]
_SKIPPED = {"report.json", "report.md"}  # timings; compared through the op histograms instead


class NotADumpError(ValueError):
    pass


def normalize(text: str) -> str:
    for pattern, replacement in _NORMALIZERS:
        text = pattern.sub(replacement, text)
    return text


@dataclass
class DumpDiff:
    op_deltas: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # "rank/tag/piece" -> op -> delta
    file_diffs: dict[str, str] = field(default_factory=dict)  # relative path -> unified diff
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.op_deltas or self.file_diffs or self.only_in_a or self.only_in_b)

    def total_deltas(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for deltas in self.op_deltas.values():
            for op, n in deltas.items():
                total[op] = total.get(op, 0) + n
        return {op: n for op, n in sorted(total.items()) if n}


def _reports(root: Path) -> dict[str, dict]:
    reports = {
        p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("rank_*/report.json"))
    }
    if not reports:
        raise NotADumpError(
            f"{root} is not a compilecore dump (no rank_*/report.json): make one with "
            "`compilecore dump --out DIR` or compilation_config.debug_dump_path"
        )
    return reports


def _histograms(reports: dict[str, dict]) -> dict[str, dict[str, int]]:
    out = {}
    for rank, report in reports.items():
        for tag, entry in report.items():
            for piece in entry["pieces"]:
                out[f"{rank}/{tag}/piece_{piece['index']:02d}"] = piece["ops"]
    return out


def _files(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in _SKIPPED
    }


def diff_dumps(a: str | Path, b: str | Path) -> DumpDiff:
    a, b = Path(a), Path(b)
    result = DumpDiff()
    hist_a, hist_b = _histograms(_reports(a)), _histograms(_reports(b))
    for piece in sorted(set(hist_a) | set(hist_b)):
        ops_a, ops_b = hist_a.get(piece, {}), hist_b.get(piece, {})
        deltas = {op: ops_b.get(op, 0) - ops_a.get(op, 0) for op in set(ops_a) | set(ops_b)}
        deltas = {op: n for op, n in sorted(deltas.items()) if n}
        if deltas:
            result.op_deltas[piece] = deltas
    files_a, files_b = _files(a), _files(b)
    result.only_in_a = sorted(set(files_a) - set(files_b))
    result.only_in_b = sorted(set(files_b) - set(files_a))
    for rel in sorted(set(files_a) & set(files_b)):
        text_a = normalize(files_a[rel].read_text(errors="replace")).splitlines(keepends=True)
        text_b = normalize(files_b[rel].read_text(errors="replace")).splitlines(keepends=True)
        if text_a != text_b:
            result.file_diffs[rel] = "".join(
                difflib.unified_diff(text_a, text_b, f"a/{rel}", f"b/{rel}", n=2)
            )
    return result


def format_deltas(deltas: dict[str, int]) -> str:
    return ", ".join(f"{'+' if n > 0 else '-'}{op} {abs(n)}" for op, n in deltas.items())


def format_diff(diff: DumpDiff, stat: bool = False) -> str:
    if diff.equal:
        return "dumps are equal"
    lines = []
    total = diff.total_deltas()
    if total:
        lines.append(f"op deltas, all pieces: {format_deltas(total)}")
    for piece, deltas in diff.op_deltas.items():
        lines.append(f"  {piece}: {format_deltas(deltas)}")
    for label, paths in (("only in A", diff.only_in_a), ("only in B", diff.only_in_b)):
        if paths:
            more = ", ..." if len(paths) > 5 else ""
            lines.append(f"{label}: {len(paths)} files ({', '.join(paths[:5])}{more})")
    lines.append(f"{len(diff.file_diffs)} files differ")
    if not stat:
        for text in diff.file_diffs.values():
            lines += ["", text.rstrip("\n")]
    return "\n".join(lines)
