#!/usr/bin/env bash
# Regenerate the leaderboards, docs/leaderboard.md (every algorithm, configs/leaderboard/fmnist.yaml) and
# docs/leaderboard-bn.md (FedBN and FedAvg on Simple-CNN with BatchNorm, configs/leaderboard/fmnist-bn.yaml):
# run each sweep (seeds 0, 1 and 2; resumable: finished runs are skipped, interrupted ones resume; failed runs
# are listed), archive the small files of the finished runs and of those a round's error stopped (configs,
# partitions, metrics, summaries, stopped.json; no checkpoints) under docs/results/runs/leaderboard-NAME,
# then write each report from that archive, in the papers' layout with its figures beside the page, so the
# pages can be rebuilt anywhere without rerunning and benchmarks/render_docs.py renders them from the
# archive (the tests compare them byte for byte). A cell shows how many seeds it has where that is fewer
# than the fullest cell's.
#   usage: benchmarks/leaderboard.sh [JOBS]          (336 runs: hours on a CPU)
# To continue on another machine, first copy the archives back, e.g.:
#   mkdir -p runs/leaderboard && cp -r docs/results/runs/leaderboard-fmnist runs/leaderboard/fmnist
set -euo pipefail
jobs=${1:-2}
for board in fmnist fmnist-bn; do
  runs=runs/leaderboard/$board archive=docs/results/runs/leaderboard-$board
  fedpcd sweep --config "configs/leaderboard/$board.yaml" --jobs "$jobs" \
    || echo "some runs of $board failed (listed above); the report shows the others" >&2
  mkdir -p "$archive"
  finished=$(cd "$runs" && find . -mindepth 2 -maxdepth 2 -name summary.json -printf '%h\n' | sort)
  # runs that a round's error stopped (stopped.json: round and error): the report lists them under the tables
  stopped=$(cd "$runs" && find . -mindepth 2 -maxdepth 2 -name stopped.json -printf '%h\n' | sort)
  # shellcheck disable=SC2086  # one folder name per word (the sweep's names have no spaces)
  tar -C "$runs" --exclude=checkpoint --exclude=.lock -cf - $finished $stopped | tar -C "$archive" -xf -
  for run in $finished; do rm -f "$archive/$run/stopped.json"; done  # went on since
done
fedpcd report docs/results/runs/leaderboard-fmnist --last 3 --out docs/leaderboard.md \
  --title "fedpcd leaderboard: Fashion-MNIST under label skew" --notes configs/leaderboard/notes.md > /dev/null
fedpcd report docs/results/runs/leaderboard-fmnist-bn --last 3 --out docs/leaderboard-bn.md \
  --title "fedpcd leaderboard: FedBN on Simple-CNN with BatchNorm" --notes configs/leaderboard/notes-bn.md > /dev/null
echo "wrote docs/leaderboard.md, docs/leaderboard-bn.md and their figures from the runs archived in docs/results/runs"
python benchmarks/render_docs.py docs/leaderboard.md docs/leaderboard/cells.csv docs/leaderboard-bn.md \
  docs/leaderboard-bn/cells.csv
