"""How long `fedpcd report` takes on the leaderboard's archive (the README's command), against reading it.

Times (median of 3, ``--repeats``, after one untimed warm-up each, the rounds interleaved so that a change of
load touches every command alike), each a fresh process started from this Python's bin/:

- reading the archive (the reference): every run's config.yaml (PyYAML's C loader), summary.json and
  metrics.jsonl parsed and nothing else done, the floor of any report of these runs;
- `fedpcd report FOLDER --last 3`: the table, the leaderboard layout and its verdicts, printed;
- `fedpcd report FOLDER --last 3 --out DIR/board.md`: the same written, with every setting's figures.

Prints the machine, the load before and after, the number of runs, and each median in seconds and as a
ratio to the reference; the printed report's seconds against the target of ``TARGET_S``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from cold_start import medians
from demo_time import cpu_model, load, machine_report

REPEATS = 3
TARGET_S = 20.0  # `fedpcd report` of the leaderboard's archive, printed, at most this many seconds
FOLDER = "docs/results/runs/leaderboard-fmnist"

# the reference: the archive's files read and parsed, as any report of them must
READ = """
import json, pathlib, sys, yaml
for summary in sorted(pathlib.Path(sys.argv[1]).rglob("summary.json")):
    yaml.load((summary.parent / "config.yaml").read_text(), Loader=yaml.CSafeLoader)
    json.loads(summary.read_text())
    [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines()]
"""


def commands(fedpcd: str, folder: str, out: str) -> dict[str, list[str]]:
    """Label -> argv; the first is the reference."""
    report = [fedpcd, "report", folder, "--last", "3"]
    return {
        "reading the archive (config, summary, metrics)": [sys.executable, "-c", READ, folder],
        "fedpcd report FOLDER --last 3": report,
        "fedpcd report FOLDER --last 3 --out board.md": [*report, "--out", str(Path(out) / "board.md")],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=FOLDER, help=f"the runs to report (default {FOLDER})")
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help=f"timed runs of each (default {REPEATS})"
    )
    parser.add_argument(
        "--json", default="docs/performance/report_speed.json", help="where the figures go (JSON)"
    )
    args = parser.parse_args(argv)
    folder = str(Path(args.folder).resolve())
    runs = len(list(Path(folder).rglob("summary.json")))
    fedpcd = str(Path(sys.executable).parent / "fedpcd")
    print(f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu_model()}")
    before = load()
    print(f"load average before: {before}")
    print(f"{args.folder}: {runs} finished runs")
    with tempfile.TemporaryDirectory(prefix="fedpcd-report-speed-") as cwd:
        median_s = medians(commands(fedpcd, folder, cwd), cwd, args.repeats)
    after = load()
    print(f"load average after: {after}")
    reference = next(iter(median_s.values()))
    print(f"median of {args.repeats} runs each, and as a ratio to the first (reading the archive):")
    for label, median in median_s.items():
        print(f"  {label:<48} {median:6.2f} s  {median / reference:6.2f} x")
    printed = median_s["fedpcd report FOLDER --last 3"]
    print(f"the printed report: {printed:.2f} s (target at most {TARGET_S:.0f} s)")
    rows = [{"command": label, "seconds": m, "ratio": m / reference} for label, m in median_s.items()]
    report = {**machine_report(before), "load_after": after, "niceness": os.nice(0), "repeats": args.repeats}
    report.update(folder=args.folder, runs=runs, target_s=TARGET_S, count=len(rows), rows=rows)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
