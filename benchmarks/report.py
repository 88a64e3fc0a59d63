"""The current performance tables, built from the newest results file of each benchmark.

    python benchmarks/report.py            # print the tables
    python benchmarks/report.py --write    # put them into README.md and docs/performance.md

Each table goes between `<!-- report:NAME -->` and `<!-- /report -->` in those files;
`tests/test_docs.py` checks that they hold what this prints, so a results file that
lands without `--write` fails the suite. Tables:

- `cpu`: batch-1 decode (greedy) and 512-token prefill per GGUF file against llama.cpp
  and ik_llama.cpp: the newest `bench_gguf.py` results that ran both peers.
- `gpu`: batch-1 decode from the newest device report (`gpu_check_*.md`).
- `performance`: both, with each source named (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
TARGETS = {"README.md": ("cpu", "gpu"), "docs/performance.md": ("performance",)}
MARKER = re.compile(r"(<!-- report:(\w+) -->\n)(.*?)(<!-- /report -->)", re.S)

# A `bench_gguf.py` title: "...; git X, llama.cpp Y (1), ik_llama.cpp Z (1), utc T, cpu C, ..."
TITLE_FIELD = re.compile(r"(git|utc|cpu|rounds) ([^,]+)")


def _fields(title: str) -> dict[str, str]:
    return dict(TITLE_FIELD.findall(title))


def newest_gguf_peers(results: Path = RESULTS) -> Path | None:
    """The newest `bench_gguf.py` results (by the time in its title) in which both
    llama.cpp and ik_llama.cpp ran."""
    found = []
    for path in results.glob("*.json"):
        data = json.loads(path.read_text())
        engines = {r.get("engine") for r in data.get("rows", [])}
        if {"llama-bench", "ik_llama.cpp llama-bench"} <= engines:
            found.append((_fields(data["title"]).get("utc", ""), path.name, path))
    return max(found)[2] if found else None


def _median(cell: str | None) -> str:
    return "-" if cell is None else cell.split(" ")[0]


def cpu_table(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    rows: dict[str, dict[str, dict]] = {}
    for r in data["rows"]:
        rows.setdefault(r["file"], {})[r["engine"]] = r
    f, m = _fields(data["title"]), data["machine"]
    isa = ", ".join(m.get("cpu_features") or []) or "features not recorded"
    command = m.get("command") or data.get("command") or "command not recorded"
    command = re.sub(r"\S*/([^/\s]+\.gguf)", r"\1", command)  # files by name, not by path
    lines = [
        f"CPU, {f.get('utc', '?')[:10]}: {m.get('cpus')} threads of {m.get('cpu_model')} "
        f"({isa}), git {f.get('git', '?')}, medians of {f.get('rounds', '?')} interleaved "
        f"rounds, tok/s; `{command}` ([{path.name}](benchmarks/results/{path.name}))",
        "",
        "| file | decode | vs llama.cpp | vs ik_llama.cpp | pp512 | vs llama.cpp | vs ik_llama.cpp"
        " |",
        "|---|---|---|---|---|---|---|",
    ]
    memory = rows.pop("(memory)", {}).get("plain sum, before each round", {})
    if memory:
        lines[0] += f"; a plain sum read {_median(memory['GB/s median (range)'])} GB/s"
    for name, engines in rows.items():
        tg, pp = engines.get("compilecore greedy", {}), engines.get("compilecore pp512", {})
        cells = [_median(tg.get("tok/s median (range)"))]
        cells += [_median(tg.get(f"vs {p}, median (range)")) for p in ("llama.cpp", "ik_llama.cpp")]
        cells += [_median(pp.get("tok/s median (range)"))]
        cells += [_median(pp.get(f"vs {p}, median (range)")) for p in ("llama.cpp", "ik_llama.cpp")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def newest_gpu_report(results: Path = RESULTS) -> Path | None:
    """The newest device report with a decode-bandwidth row (by the date in its name)."""
    found = [p for p in results.glob("gpu_check_*.md") if "| decode_bandwidth |" in p.read_text()]
    return max(found, key=lambda p: p.name) if found else None


# Reports before 2026-12-05 give decode's read rate as a share of a copy's rate, which counts
# only the bytes a copy reads: "618 tok/s = 60% of copy (2126 GB/s)".
OF_COPY = re.compile(r"(\d+)% of copy \((\d+) GB/s\)")


def gpu_lines(path: Path) -> list[str]:
    """The device report's decode row, with its read rate as a fraction of the part's
    nominal HBM bandwidth (`gpu_check.NOMINAL_TB_S`)."""
    from gpu_check import nominal_bandwidth  # the table the device check itself uses

    text = path.read_text()
    heading = text.splitlines()[0].lstrip("# ")
    row = next(ln for ln in text.splitlines() if ln.startswith("| decode_bandwidth |"))
    detail = row.strip("| ").split(" | ")[-1]
    part, match = nominal_bandwidth(heading), OF_COPY.search(detail)
    if part and match:
        tb_s = int(match[1]) / 100 * int(match[2]) / 1000
        detail += f"; read {tb_s:.2f} TB/s = {tb_s / part[1]:.0%} of the {part[0]}'s nominal "
        detail += f"{part[1]} TB/s"
    return [f"GPU ({heading}; [{path.name}](benchmarks/results/{path.name})): {detail}."]


def tables(results: Path = RESULTS) -> dict[str, str]:
    cpu, gpu = newest_gguf_peers(results), newest_gpu_report(results)
    out = {
        "cpu": "\n".join(cpu_table(cpu)) if cpu else "No CPU results with both peers yet.",
        "gpu": "\n".join(gpu_lines(gpu)) if gpu else "No device report yet.",
    }
    # docs/ is one folder down: its links to results go up one.
    out["performance"] = (out["cpu"] + "\n\n" + out["gpu"]).replace(
        "](benchmarks/", "](../benchmarks/"
    )
    return out


def render(text: str, made: dict[str, str]) -> str:
    """`text` with each marked table replaced by its current form."""
    return MARKER.sub(lambda m: m[1] + made[m[2]] + "\n" + m[4], text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md and docs/")
    args = parser.parse_args()
    made = tables()
    if not args.write:
        for name, text in made.items():
            print(f"<!-- report:{name} -->\n{text}\n")
        return
    for target in TARGETS:
        path = ROOT / target
        path.write_text(render(path.read_text(), made))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
