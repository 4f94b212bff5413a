#!/usr/bin/env bash
# Regenerate one CPU-scale results table of docs/results/: run the sweep (resumable: finished runs are
# skipped, interrupted ones resume), write the report, and archive the runs' small files (configs,
# metrics, summaries; no checkpoints) under docs/results/runs/NAME so the table can be rebuilt anywhere.
#   usage: benchmarks/reproduce.sh NAME [JOBS]     NAME: a sweep file configs/repro/NAME.yaml
#   e.g.   benchmarks/reproduce.sh generic-baselines 2
# To continue on another machine, first copy an archive back: cp -r docs/results/runs/NAME runs/repro/
set -euo pipefail
name=${1:?usage: benchmarks/reproduce.sh NAME [JOBS]}
jobs=${2:-2}
config=configs/repro/$name.yaml
[[ -f $config ]] || { echo "no sweep file $config; choose one of: $(ls configs/repro | sed 's/.yaml//' | tr '\n' ' ')" >&2; exit 2; }
fedpcd sweep --config "$config" --jobs "$jobs"
fedpcd report "runs/repro/$name" --last 5 --out "docs/results/$name-report"
mkdir -p docs/results/runs
tar -C runs/repro --exclude=checkpoint --exclude=.lock --exclude=partition.json -cf - "$name" | tar -C docs/results/runs -xf -
