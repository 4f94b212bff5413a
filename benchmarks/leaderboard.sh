#!/usr/bin/env bash
# Regenerate docs/leaderboard.md: run the leaderboard sweep (resumable: finished runs are skipped, interrupted
# ones resume; failed runs are listed), write the report in the papers' layout with its figures under
# docs/leaderboard/, and archive
# the finished runs' small files (configs, partitions, metrics, summaries; no checkpoints) under
# docs/results/runs/leaderboard-fmnist so the report can be rebuilt anywhere without rerunning.
#   usage: benchmarks/leaderboard.sh [JOBS]          (about 3 CPU hours for the 231 runs)
# To continue on another machine, first copy the archive back:
#   mkdir -p runs/leaderboard && cp -r docs/results/runs/leaderboard-fmnist runs/leaderboard/fmnist
set -euo pipefail
jobs=${1:-2}
fedpcd sweep --config configs/leaderboard/fmnist.yaml --jobs "$jobs" || echo "some runs failed (listed above); the report shows the others" >&2
fedpcd report runs/leaderboard/fmnist --last 3 --out docs/leaderboard.md \
  --title "fedpcd leaderboard: Fashion-MNIST under label skew" --notes configs/leaderboard/notes.md > /dev/null
mkdir -p docs/results/runs/leaderboard-fmnist
finished=$(cd runs/leaderboard/fmnist && find . -mindepth 2 -maxdepth 2 -name summary.json -printf '%h\n' | sort)
# shellcheck disable=SC2086  # one folder name per word (the sweep's names have no spaces)
tar -C runs/leaderboard/fmnist --exclude=checkpoint -cf - $finished | tar -C docs/results/runs/leaderboard-fmnist -xf -
echo "wrote docs/leaderboard.md and docs/leaderboard/; runs archived in docs/results/runs/leaderboard-fmnist"
