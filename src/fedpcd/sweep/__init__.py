"""``fedpcd sweep``: a grid of runs from one file, resumable.

A sweep file is a normal config plus a top-level ``sweep:`` mapping of (dotted) keys to lists of values;
a value that is a mapping replaces that whole section. The grid is the product of the lists, and each run
goes to ``<output_dir>/<name>``, its name built from the swept values::

    output_dir: runs/repro/fmnist
    sweep:
      partition: [{scheme: pathological, classes_per_client: 2}, {scheme: dirichlet, beta: 0.1}]
      algorithm: [{name: fedavg}, {name: fedprox, mu: 0.01}]
      seed: [0, 1, 2]

A grid holds at most ``MAX_RUNS`` (100,000) runs: a larger one is refused in one line, counted before any
run is built.

The reserved axis ``setting`` varies several keys together: each value is a mapping of (dotted) keys to
values, applied at once, with an optional ``label`` that names it in the folder (e.g. P5C2 needs both
``clients: 5`` and its partition)::

    sweep:
      setting:
        - {label: P10C2, partition: {scheme: pathological, classes_per_client: 2}}
        - {label: P5C2, clients: 5, partition: {scheme: pathological, classes_per_client: 2}}

Every sweep keeps ``<output_dir>/index.sqlite``, one row per run of the grid (its config and summary as JSON
plus the headline numbers as columns), updated as runs finish (``sweep.index``). With ``tracking.loggers``,
each run is its own tracker run, grouped under the name of the sweep's output_dir (``tracking.group`` unless
the file sets it).

Running the sweep again skips finished runs and resumes interrupted ones from their checkpoints. A run that
fails (an exception, e.g. a diverging method) is reported and the sweep goes on with the others; so is a run
that cannot be run now (held by another fedpcd process, started without a checkpoint, or with a corrupt
summary.json). A run whose worker process died (killed, or a plugin ended it) runs once more on a fresh
worker, then counts as failed. The sweep succeeds (exit code 0) when every run of its grid is finished at its
end, whoever finished it; otherwise it ends with one line counting the runs that failed, were skipped and
finished. While it runs, a progress line (runs finished, running with their last evaluated round, failed, and
an ETA from the wall times of the runs finished so far) is printed as each run ends and every
``PROGRESS_EVERY`` seconds between (``sweep.progress``).

Where the runs execute is the launcher's business (``fedpcd.launchers``: this process, a pool of worker
processes, Ray, Slurm): it only runs ``sweep.run.run_one``; everything above is the same for each.

fedpcd never writes through a symbolic link in a sweep folder: an ``index.sqlite`` (or its SQLite side
files) or a run folder that is a link is refused with one line before anything runs, as links in a run
folder are (``engine/rundir.py``); the sweep's ``output_dir`` itself is the user's path and may be a link.

The modules, by job: ``grid`` (the grid of configs), ``status`` (where one run stands), ``index`` (the SQLite
index), ``progress`` (the progress line) and ``run`` (``run_sweep``); importers use them directly.
"""
