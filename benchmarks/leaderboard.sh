#!/usr/bin/env bash
# Regenerate docs/leaderboard.md: run the leaderboard sweep (seeds 0, 1 and 2; resumable: finished runs are
# skipped, interrupted ones resume; failed runs are listed), archive the small files of the finished runs and
# of those a round's error stopped (configs, partitions, metrics, summaries, stopped.json; no checkpoints)
# under docs/results/runs/leaderboard-fmnist, then write the report from that archive, in the papers' layout
# with its figures under docs/leaderboard/, so the page can be rebuilt anywhere without rerunning and
# benchmarks/render_docs.py renders it from the archive (the tests compare it byte for byte).
# A cell shows how many seeds it has where that is fewer than the fullest cell's.
#   usage: benchmarks/leaderboard.sh [JOBS]          (294 runs per seed: hours on a CPU)
# To continue on another machine, first copy the archive back:
#   mkdir -p runs/leaderboard && cp -r docs/results/runs/leaderboard-fmnist runs/leaderboard/fmnist
set -euo pipefail
jobs=${1:-2}
fedpcd sweep --config configs/leaderboard/fmnist.yaml --jobs "$jobs" || echo "some runs failed (listed above); the report shows the others" >&2
mkdir -p docs/results/runs/leaderboard-fmnist
finished=$(cd runs/leaderboard/fmnist && find . -mindepth 2 -maxdepth 2 -name summary.json -printf '%h\n' | sort)
# runs that a round's error stopped (stopped.json: round and error): the report lists them under the tables
stopped=$(cd runs/leaderboard/fmnist && find . -mindepth 2 -maxdepth 2 -name stopped.json -printf '%h\n' | sort)
# shellcheck disable=SC2086  # one folder name per word (the sweep's names have no spaces)
tar -C runs/leaderboard/fmnist --exclude=checkpoint --exclude=.lock -cf - $finished $stopped | tar -C docs/results/runs/leaderboard-fmnist -xf -
for run in $finished; do rm -f "docs/results/runs/leaderboard-fmnist/$run/stopped.json"; done  # went on since
fedpcd report docs/results/runs/leaderboard-fmnist --last 3 --out docs/leaderboard.md \
  --title "fedpcd leaderboard: Fashion-MNIST under label skew" --notes configs/leaderboard/notes.md > /dev/null
echo "wrote docs/leaderboard.md and docs/leaderboard/ from the runs archived in docs/results/runs/leaderboard-fmnist"
python benchmarks/render_docs.py docs/leaderboard.md docs/leaderboard/cells.csv
