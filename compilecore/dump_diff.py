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

from compilecore.dump import module_entries

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
class PassChange:
    """What one pass rewrote in one dump: its own before -> after diff, with the pieces
    whose rewrite reads the same grouped together."""

    name: str
    side: str  # "B", "A" (the pass ran only there) or "A -> B" (it rewrote differently)
    groups: list[tuple[list[str], str]]  # (pieces, unified diff of the pass's graphs)


@dataclass
class DumpDiff:
    # "rank/tag/piece" -> op -> delta
    op_deltas: dict[str, dict[str, int]] = field(default_factory=dict)
    pass_changes: list[PassChange] = field(default_factory=list)
    file_diffs: dict[str, str] = field(default_factory=dict)  # relative path -> unified diff
    kernel_diffs: dict[str, str] = field(default_factory=dict)  # Inductor's code (inductor/)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (
            self.op_deltas or self.pass_changes or self.file_diffs or self.kernel_diffs
            or self.only_in_a or self.only_in_b
        )  # fmt: skip

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
        for tag, entry in module_entries(report).items():
            for piece in entry["pieces"]:
                out[f"{rank}/{tag}/piece_{piece['index']:02d}"] = piece["ops"]
    return out


def _files(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in _SKIPPED and "passes" not in p.relative_to(root).parts
    }


def _unified(text_a: str, text_b: str, label_a: str, label_b: str) -> str:
    a = normalize(text_a).splitlines(keepends=True)
    b = normalize(text_b).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, label_a, label_b, n=2))


def _pass_rewrites(root: Path) -> dict[str, dict[str, str]]:
    """pass name -> "rank/tag/piece" -> the diff of that pass's own before/after graphs."""
    out: dict[str, dict[str, str]] = {}
    for before in sorted(root.glob("rank_*/*/passes/*/*.before.py")):
        name = before.name[: -len(".before.py")]
        after = before.with_name(f"{name}.after.py")
        if not after.is_file():
            continue
        rank, tag, _, piece = before.relative_to(root).parts[:4]
        text = _unified(before.read_text(), after.read_text(), "before", "after")
        out.setdefault(name, {})[f"{rank}/{tag}/{piece}"] = text
    return out


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _grouped(by_piece: dict[str, str]) -> list[tuple[list[str], str]]:
    groups: dict[str, list[str]] = {}
    for piece in sorted(by_piece, key=_natural):
        text = by_piece[piece]
        groups.setdefault(text, []).append(piece)
    return sorted(((pieces, text) for text, pieces in groups.items()), key=lambda g: -len(g[0]))


def _pass_changes(a: Path, b: Path) -> list[PassChange]:
    rewrites_a, rewrites_b = _pass_rewrites(a), _pass_rewrites(b)
    changes = []
    for name in sorted(set(rewrites_a) | set(rewrites_b)):
        in_a, in_b = rewrites_a.get(name), rewrites_b.get(name)
        if in_a == in_b:
            continue  # the pass rewrote the same sites the same way in both dumps
        side = "B" if in_a is None else "A" if in_b is None else "A -> B"
        changes.append(PassChange(name, side, _grouped(in_b if in_b is not None else in_a)))
    return changes


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
    result.pass_changes = _pass_changes(a, b)
    files_a, files_b = _files(a), _files(b)
    result.only_in_a = sorted(set(files_a) - set(files_b))
    result.only_in_b = sorted(set(files_b) - set(files_a))
    for rel in sorted(set(files_a) & set(files_b)):
        text = _unified(
            files_a[rel].read_text(errors="replace"),
            files_b[rel].read_text(errors="replace"),
            f"a/{rel}",
            f"b/{rel}",
        )
        if text:
            kind = result.kernel_diffs if "inductor" in Path(rel).parts else result.file_diffs
            kind[rel] = text
    return result


def format_deltas(deltas: dict[str, int]) -> str:
    return ", ".join(f"{'+' if n > 0 else '-'}{op} {abs(n)}" for op, n in deltas.items())


def format_pieces(pieces: list[str]) -> str:
    """`rank_0/LlamaModel.model/piece_02..piece_58 (29 pieces)` for a group of pieces."""
    if len(pieces) == 1:
        return pieces[0]
    first, last = pieces[0], pieces[-1].rsplit("/", 1)[-1]
    return f"{first}..{last} ({len(pieces)} pieces)"


def _grouped_deltas(op_deltas: dict[str, dict[str, int]]) -> list[tuple[list[str], str]]:
    return _grouped({piece: format_deltas(d) for piece, d in op_deltas.items()})


def format_diff(diff: DumpDiff, stat: bool = False, kernels: bool = False) -> str:
    """Passes first (what each rewrote), then op deltas with identical pieces grouped,
    then the other files; Inductor's code only with `kernels`."""
    if diff.equal:
        return "dumps are equal"
    lines = []
    for change in diff.pass_changes:
        sites = sum(len(pieces) for pieces, _ in change.groups)
        lines.append(f"pass {change.name} (rewrote in {change.side}, {sites} pieces):")
        for pieces, text in change.groups:
            lines.append(f"  {format_pieces(pieces)}")
            if not stat:
                lines += ["    " + line for line in text.rstrip("\n").splitlines()]
    total = diff.total_deltas()
    if total:
        lines.append(f"op deltas, all pieces: {format_deltas(total)}")
    for pieces, text in _grouped_deltas(diff.op_deltas):
        lines.append(f"  {format_pieces(pieces)}: {text}")
    for label, paths in (("only in A", diff.only_in_a), ("only in B", diff.only_in_b)):
        if paths:
            more = ", ..." if len(paths) > 5 else ""
            lines.append(f"{label}: {len(paths)} files ({', '.join(paths[:5])}{more})")
    lines.append(f"{len(diff.file_diffs)} files differ")
    if diff.kernel_diffs:
        hint = "" if kernels else " (--kernels shows them)"
        lines.append(f"{len(diff.kernel_diffs)} Inductor code files differ{hint}")
    if not stat:
        for text in diff.file_diffs.values():
            lines += ["", text.rstrip("\n")]
        for text in diff.kernel_diffs.values() if kernels else ():
            lines += ["", text.rstrip("\n")]
    return "\n".join(lines)
