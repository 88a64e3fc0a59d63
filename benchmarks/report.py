"""The current performance tables, built from the newest results file of each benchmark.

    python benchmarks/report.py            # print the tables
    python benchmarks/report.py --write    # put them into README.md and docs/performance.md
    python benchmarks/report.py --sittings gguf_peers_spr4 gguf_peers_spr5  # medians over several

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
import statistics
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


def sittings_table(paths: list[Path]) -> list[str]:
    """Several `bench_gguf.py` sittings at once: per file, the median over the sittings of
    each sitting's median ratio (ours over each peer, decode and pp512) and, per sitting,
    our decode's MB a token and GB/s beside that sitting's plain sum."""
    ratios: dict[str, dict[str, list[float]]] = {}
    reads: dict[str, list[str]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        memory = "-"
        for r in data["rows"]:
            if r["file"] == "(memory)":
                memory = _median(r.get("GB/s median (range)"))
                continue
            for peer in ("llama.cpp", "ik_llama.cpp"):
                cell = r.get(f"vs {peer}, median (range)")
                if cell and r["engine"] in ("compilecore greedy", "compilecore pp512"):
                    key = ("decode" if "greedy" in r["engine"] else "pp512") + " vs " + peer
                    cells = ratios.setdefault(r["file"], {})
                    cells.setdefault(key, []).append(float(_median(cell)))
            if r["engine"] == "compilecore greedy" and "MB a token" in r:
                gbs = _median(r.get("GB/s median (range)"))
                read = f"{r['MB a token']} MB, {gbs} of {memory} GB/s"
                reads.setdefault(r["file"], []).append(read)
    keys = [f"{w} vs {p}" for w in ("decode", "pp512") for p in ("llama.cpp", "ik_llama.cpp")]
    lines = [f"Medians over {len(paths)} sittings: " + ", ".join(p.name for p in paths), "",
             "| file | " + " | ".join(keys) + " | decode read, each sitting |",
             "|---|" + "---|" * (len(keys) + 1)]  # fmt: skip
    for name, cells in ratios.items():
        values = [statistics.median(cells[k]) if cells.get(k) else None for k in keys]
        shown = ["-" if v is None else f"{v:.2f}" for v in values]
        lines.append(f"| {name} | " + " | ".join(shown) + f" | {'; '.join(reads.get(name, []))} |")
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
    parser.add_argument("--sittings", nargs="+", metavar="NAME",
                        help="print medians over these bench_gguf.py results instead")  # fmt: skip
    args = parser.parse_args()
    if args.sittings:
        print("\n".join(sittings_table([RESULTS / f"{n}.json" for n in args.sittings])))
        return
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
