"""Dumping what the compiler did, as readable files (`compilation_config.debug_dump_path`).

Under DIR/rank_<r>/<module tag>/:

    transformed_code.py    Dynamo's bytecode for forward, decompiled by depyf
    dynamo_graph.py        the traced graph, before the split
    split_graph.py         the graph that calls the pieces in order
    pieces/piece_NN.py     each piece (attention pieces too)
    passes/piece_N/        each compiled piece before and after each pass
    inductor/piece_N.py    Inductor's output code per compiled piece (piece_N_size_S.py:
                           the code for compile size S)

and DIR/rank_<r>/report.json + report.md: pieces with op histograms, pass match counts,
compile times, the cache key and its factors, versions. `compilecore diff` compares two.
Each CPU graph the engine records adds DIR/rank_<r>/cpu_graphs/size_N.txt (the program
the replay runs: every call, the parallel regions the region pass formed, the barriers,
where each call came from) and the same as data under report.json's "cpu_graphs".
"""

from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path
from typing import Any

from torch import fx

from compilecore.config import EngineConfig


def dump_root(engine_config: EngineConfig) -> Path | None:
    path = engine_config.compilation_config.debug_dump_path
    if not path:
        return None
    from compilecore.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return Path(path) / f"rank_{pp.rank_in_group * tp.world_size + tp.rank_in_group}"


CPU_GRAPHS = "cpu_graphs"  # report.json's key for the recorded programs (not a module)


def module_entries(report: dict[str, Any]) -> dict[str, Any]:
    """report.json's compiled modules (tag -> entry), without the CPU graphs' programs."""
    return {tag: entry for tag, entry in report.items() if tag != CPU_GRAPHS}


def write_cpu_graph(root: Path, size: int, graph: Any) -> None:
    """A recorded CPU graph's program into the dump under `root` (a rank's folder)."""
    folder = root / CPU_GRAPHS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"size_{size}.txt").write_text(graph.program_text())
    path = root / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report.setdefault(CPU_GRAPHS, {})[f"size_{size}"] = graph.program_data()
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    (root / "report.md").write_text(report_markdown(report))


_FREES = re.compile(r";\s+[\w\s=]+= None$")


def wrap_long_lines(src: str, width: int = 100) -> str:
    """Drop FX's `;  a = b = None` frees (a chain of every weight name after each piece
    call) and break code lines longer than `width` after a comma (a call's arguments),
    continuation lines indented under the call."""
    out = []
    for line in src.splitlines():
        line = _FREES.sub("", line)
        if len(line) <= width or line.lstrip().startswith("#") or "(" not in line:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        current = ""
        for part in line.split(", "):
            piece = part if not current else ", " + part
            if current and len(current) + len(piece) > width:
                out.append(current + ",")
                current = indent + part
            else:
                current += piece
        out.append(current)
    return "\n".join(out) + "\n"


def _readable(gm: fx.GraphModule) -> str:
    text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    return wrap_long_lines(text)


def _torch_op_histogram(gm: fx.GraphModule) -> dict[str, int]:
    from passes.manager import op_name

    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = op_name(node.target) if node.op == "call_function" else f"Tensor.{node.target}"
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def write_graphs(folder: Path, gm: fx.GraphModule, split_gm: fx.GraphModule, pieces) -> None:
    (folder / "pieces").mkdir(parents=True, exist_ok=True)
    (folder / "dynamo_graph.py").write_text(_readable(gm))
    (folder / "split_graph.py").write_text(wrap_long_lines(split_gm.code))
    for piece in pieces:
        (folder / "pieces" / f"piece_{piece.index:02d}.py").write_text(_readable(piece.graph))


def write_inductor_code(folder: Path, name: str, artifact: Any) -> None:
    # The generated module's source is private to Inductor: dump it when it is there.
    source = getattr(getattr(artifact, "_compiled_fn", None), "source_code", None)
    if source:
        (folder / "inductor").mkdir(parents=True, exist_ok=True)
        (folder / "inductor" / f"{name}.py").write_text(str(source))


def write_transformed_code(folder: Path, code: types.CodeType) -> None:
    os.environ.setdefault("PYTHONBREAKPOINT", "0")  # depyf's debug helpers must never block
    import depyf

    try:
        source = depyf.decompile(code)
    except Exception as e:  # a decompiler gap must not break compilation
        source = f"# depyf could not decompile this code object: {e}\n"
    (folder / "transformed_code.py").write_text(source)


def piece_report(backend) -> list[dict[str, Any]]:
    histograms = backend.pass_manager.histograms
    rows = []
    for piece in backend.pieces:
        row: dict[str, Any] = {"index": piece.index, "name": piece.name}
        if piece.is_splitting_op:
            row.update(kind="attention", ops=_torch_op_histogram(piece.graph))
        else:
            canonical = backend.canonical.get(piece.name)
            found = histograms.get(canonical, {})
            matches = {
                name[len(canonical) :].lstrip("_") or "general": counts
                for name, counts in backend.stats.piece_matches.items()
                if name == canonical or name.startswith(canonical + "_size_")
            }
            row.update(
                kind="compiled",
                compiled_as=canonical,
                ops=found.get("after", {}),
                ops_before_passes=found.get("before", {}),
                pass_matches={v: {k: n for k, n in c.items() if n} for v, c in matches.items()},
            )
        rows.append(row)
    return rows


def write_report(root: Path, tag: str, backend) -> None:
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    stats = backend.stats
    entry = {
        "versions": {n: version(n) for n in ("torch", "triton", "depyf", "transformers")},
        "cache_factors": stats.factors,
        "compile_seconds": {
            "tracing": stats.trace_s,
            "inductor": stats.inductor_s,
            "loading": stats.load_s,
        },
        "pass_matches": stats.pass_matches,
        "pass_matches_by_variant": stats.pass_matches_by_variant,
        "pieces": piece_report(backend),
    }
    path = root / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report[tag] = entry
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    (root / "report.md").write_text(report_markdown(report))


def _matches_table(entry: dict[str, Any]) -> list[str]:
    """Sites each pass rewrote, over every piece, per variant of the code (the
    symbolic-size code and each compile size); a pass that matched nothing shows 0."""
    by_variant = entry.get("pass_matches_by_variant") or {"general": entry["pass_matches"]}
    variants = sorted(by_variant, key=lambda v: (v != "general", len(v), v))
    names = sorted({name for counts in by_variant.values() for name in counts})
    lines = ["| pass | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for name in names:
        counts = [str(by_variant[v].get(name, 0)) for v in variants]
        lines.append(f"| {name} | " + " | ".join(counts) + " |")
    return lines


def report_markdown(report: dict[str, Any]) -> str:
    lines = ["# compilecore dump", ""]
    for tag, entry in module_entries(report).items():
        secs = entry["compile_seconds"]
        lines += [
            f"## {tag}",
            "",
            f"torch {entry['versions']['torch']}, triton {entry['versions']['triton']}; "
            f"compile: tracing {secs['tracing']:.1f} s, Inductor {secs['inductor']:.1f} s, "
            f"loading {secs['loading']:.1f} s",
            "",
            "| piece | kind | compiled as | ops | most frequent | pass matches |",
            "|---|---|---|---|---|---|",
        ]
        for p in entry["pieces"]:
            top = sorted(p["ops"].items(), key=lambda kv: -kv[1])[:4]
            top_s = ", ".join(f"{k} {v}" for k, v in top)
            shared = p.get("compiled_as") or ""
            if shared and shared != f"piece_{p['index']}":
                shared += " (shared)"
            matches = "; ".join(
                f"{variant}: " + ", ".join(f"{k} {n}" for k, n in sorted(c.items()))
                for variant, c in sorted(p.get("pass_matches", {}).items())
                if c
            )
            lines.append(
                f"| {p['index']} | {p['kind']} | {shared} | {sum(p['ops'].values())} | {top_s} "
                f"| {matches} |"
            )
        lines += ["", *_matches_table(entry), "", "Cache key factors:", ""]
        lines += [f"- {k}: `{str(v)[:120]}`" for k, v in sorted(entry["cache_factors"].items())]
        lines.append("")
    graphs = report.get(CPU_GRAPHS, {})
    if graphs:
        lines += ["## CPU graphs", "", "| size | calls | parallel regions | team calls | "
                  "plain calls | barriers |", "|---|---|---|---|---|---|"]  # fmt: skip
        for size, program in sorted(graphs.items(), key=lambda kv: int(kv[0].split("_")[1])):
            st = program["stats"]
            lines.append(f"| {size.split('_')[1]} | {len(program['calls'])} | "
                         f"{st['parallel_regions']} | {st['team_calls']} | {st['plain_calls']} "
                         f"| {st['barriers']} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)
