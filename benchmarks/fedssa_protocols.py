"""FedSSA's two readings of "mean local test accuracy" (Yi et al., IJCAI 2024, Sec. 6.1) from finished runs.

For each setting (seeds grouped as in ``fedpcd report``), mean +- std over seeds of:
- last-k: the participants' mean PA-split averaged over the last k evaluated rounds (the report's PA-split);
- best: the maximum over rounds of the participants' mean PA-split (the official code's number, [C]);
- all-clients: every client's most recent PA-split, averaged over all clients ever evaluated (the
  paper's "average test accuracy of all clients' local models"; unweighted, since the runs record
  per-client accuracies but not test-split sizes).

usage: python benchmarks/fedssa_protocols.py runs/repro/fedssa-fmnist-n50 [--last 5]
"""

from __future__ import annotations

import argparse
import statistics

from fedpcd.report.groups import group_runs, setting_columns
from fedpcd.report.read import load_runs
from fedpcd.report.stats import last_mean, mean_std


def best_round(records: list[dict]) -> float:
    """max over evaluated rounds of the participants' mean PA-split."""
    return max(r["personal_acc"] for r in records if r.get("personal_acc") is not None)


def all_clients(records: list[dict]) -> float:
    """mean over clients of each client's most recent PA-split."""
    latest: dict[int, float] = {}
    for r in records:
        latest.update(zip(r.get("clients", []), r.get("client_pa_split") or [], strict=False))
    return statistics.fmean(latest.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir")
    parser.add_argument("--last", type=int, default=5)
    args = parser.parse_args()
    varying, groups = group_runs(load_runs(args.runs_dir))
    print(f"| setting | PA-split last-{args.last} | PA-split best round | PA-split all clients |")
    print("|---|---|---|---|")
    for key, runs in groups.items():
        name = " ".join(setting_columns(varying, key).values())
        last = [last_mean(r.records, "personal_acc", args.last) for r in runs]
        best = [best_round(r.records) for r in runs]
        every = [all_clients(r.records) for r in runs]
        print(f"| {name} | {mean_std(last)} | {mean_std(best)} | {mean_std(every)} |")


if __name__ == "__main__":
    main()
