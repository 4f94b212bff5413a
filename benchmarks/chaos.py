"""Chaos: random faults against fedpcd's reliability promises, each followed by the documented recovery.

Each fault runs one tiny command in its own folder and hits it at a random moment: SIGKILL, SIGINT (to the
process group, as a terminal's Ctrl-C), SIGTERM or SIGHUP (to the command's process, as ``kill`` does) during

- ``run``: a run (``fedpcd run``);
- ``workers``: a run with ``engine.workers=2`` (a pool of client processes);
- ``sweep``: a sweep of two runs with ``--jobs 2`` (worker processes);
- ``disk``: a run whose process may write files of at most a random size of 1 to 128 KiB (``RLIMIT_FSIZE``:
  the first write past it fails as on a full disk; no root mounts needed), no signal;
- ``flower``: a run on Flower's simulation (``backend=flower``: Ray actors as ClientApps);
- ``hang``: a Flower run whose ClientApp of client 0 never answers in the last round (an installed plugin
  makes it sleep 10^6 s), no signal: it is left out of that round after ``flower.round_timeout``
  (HANG_TIMEOUT_S) and the finished run must exit by itself (within LIMIT_S).

A fault that hits nothing (a signal drawn after the command's end, a size limit above every file it writes)
is reported as missed and drawn again (a signal's kind's time shrunk to the measured one), so every counted
fault hit its command.

Then the documented recovery: ``fedpcd run --resume`` for a run folder holding a config.yaml, the same
``fedpcd run`` command for one stopped before it wrote one, the same ``fedpcd sweep`` command for a sweep;
none for a hung client (the run finishes without it). Each fault is checked against an uninterrupted
reference run of the same config: metrics.jsonl equal (but wall times; a hung client's run: every round but
the last, which must be there), the csv tracker's metrics.csv equal (but wall times), no process of the
faulted command left, no temp file left, no traceback (every failure is one line), an exit code of a clean end
(:func:`exit_codes`; 0 only for a run that had finished before the signal). Prints a line per fault
and ``faults injected / survived / data lost``; exits 1 when a fault was not survived (a check failed) or
lost data (metrics differ or could not be recovered).

A Flower fault costs a Ray start-up (20 s to a minute on a small machine, a hung client the round timeout
too), so ``flower`` and ``hang`` are drawn less often than the others (KINDS' weights); ``--kinds`` picks
the kinds drawn.

    python benchmarks/chaos.py [--faults 30] [--seed 0] [--dataset fmnist] [--kinds run,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

SIGNALS = (signal.SIGKILL, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
KINDS = {"run": 4, "workers": 4, "sweep": 4, "disk": 4, "flower": 1, "hang": 1}  # kind -> weight of its draw
FLOWER_KINDS = ("flower", "hang")
HANG_TIMEOUT_S = 30  # a hung client's run: flower.round_timeout
LIMIT_S = 900.0  # a faulted command still running after this is stopped (and the fault not survived)
DISK_LIMITS = (2**10, 2**17)  # a "disk" fault's largest file: log-uniform between these (bytes)
DATA = {  # tiny runs: a few seconds each
    "fmnist": ["dataset.name=fmnist", "dataset.train_fraction=0.02"],
    "synthetic": ["dataset.name=synthetic"],
}
COMMON = [
    "model.name=mlp",
    "model.hidden=32",
    "clients=4",
    "rounds=4",
    "local.batch_size=32",
    "engine.checkpoint_every=1",
    "tracking.loggers=[csv]",
]


@dataclass
class Fault:
    kind: str
    sig: int | None  # None: the "disk" fault
    at: float  # seconds after the start
    disk: int | None = None  # the "disk" fault's file size limit (bytes)


def fedpcd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "fedpcd.cli", *argv]


# an installed plugin (imported by every process that looks a model up, Ray's ClientApp actors included)
# that makes client 0's ClientApp sleep "forever" in the last round
HANG_PLUGIN = """
import sys, time
client_app = sys.modules.get("fedpcd.flower.client_app")
if client_app is not None:
    run_client = client_app.run_client

    def hanging(algorithm, fed, task):
        if task.client == 0 and task.round == fed.config.rounds:
            time.sleep(10**6)
        return run_client(algorithm, fed, task)

    client_app.run_client = hanging
"""


def hang_plugin(site: Path) -> Path:
    """Install :data:`HANG_PLUGIN` in the folder ``site`` (a dist-info with its entry point); returns it."""
    info = site / "fedpcd_chaos_hang-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Name: fedpcd-chaos-hang\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedpcd.models]\nchaos_hang = fedpcd_chaos_hang\n")
    (site / "fedpcd_chaos_hang.py").write_text(HANG_PLUGIN)
    return site


def command(kind: str, out: Path, data: list[str]) -> list[str]:
    """The command of a fault of ``kind`` writing to ``out`` (a run folder, or a sweep's folder)."""
    if kind == "sweep":
        spec = out.parent / f"{out.name}.sweep.yaml"
        spec.write_text(yaml.safe_dump({"output_dir": str(out), "sweep": {"seed": [0, 1]}}))
        return fedpcd("sweep", "--config", str(spec), "--jobs", "2", *data, *COMMON)
    extra = {
        "workers": ["engine.workers=2"],
        "flower": ["backend=flower"],
        "hang": ["backend=flower", f"flower.round_timeout={HANG_TIMEOUT_S}"],
    }.get(kind, [])
    return fedpcd("run", "--quiet", *data, *COMMON, *extra, f"output_dir={out}")


def run_folders(kind: str, out: Path) -> list[Path]:
    return [out / "seed0", out / "seed1"] if kind == "sweep" else [out]


def records(run: Path) -> list[dict[str, object]]:
    """metrics.jsonl without wall times (the rest of a resumed run is bitwise the uninterrupted one's)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"} for line in lines]


def csv_rows(run: Path) -> list[dict[str, str]]:
    """The csv tracker's metrics.csv without wall times and empty cells (a column only some rounds have, such
    as a hung client's ``left_out``, is empty in the others)."""
    rows = csv.DictReader(io.StringIO((run / "metrics.csv").read_text()))
    return [{k: v for k, v in row.items() if k != "wall_s" and v != ""} for row in rows]


def child_setup(disk: int | None) -> Callable[[], None]:
    """For the child: the signals a fault sends at their default disposition, whatever this process inherited
    (run in the background of a shell, it ignores SIGINT; under nohup, SIGHUP: the command would inherit that
    and never see the fault); with ``disk``, files of at most ``disk`` bytes (a write past it fails with
    EFBIG: a full disk)."""

    def setup() -> None:
        for sig in (s for s in SIGNALS if s != signal.SIGKILL):  # SIGKILL has no disposition to reset
            signal.signal(sig, signal.SIG_DFL)
        if disk:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (disk, disk))

    return setup


def watch(proc: subprocess.Popen[bytes], seen: set[int], until: float | None) -> None:
    """Collect the pids of ``proc``'s descendants into ``seen`` until it ends or ``until`` (monotonic)."""
    while proc.poll() is None and (until is None or time.monotonic() < until):
        with contextlib.suppress(psutil.Error):
            seen.update(child.pid for child in psutil.Process(proc.pid).children(recursive=True))
        time.sleep(0.05)


def start(
    argv: list[str], log: Path, disk: int | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            argv,
            stdout=fh,
            stderr=fh,
            env=env,
            start_new_session=True,  # a group of its own: its Ctrl-C reaches it and its children only
            preexec_fn=child_setup(disk),  # noqa: PLW1509 - signal dispositions and a resource limit
        )


def inject(
    fault: Fault, argv: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[int | None, set[int], float | None, float | None]:
    """Run ``argv``, hit it as ``fault`` says; (its exit code, None if it was still running after LIMIT_S
    and was killed; the pids of every process it started; for a signal fault that came too late, the
    seconds the command took: it ended before the signal, which then hit nothing; the wall-clock time the
    signal was sent, else None)."""
    seen: set[int] = set()
    t0 = time.monotonic()
    proc = start(argv, log, disk=fault.disk, env=env)
    end = t0 + LIMIT_S
    watch(proc, seen, t0 + fault.at)
    missed = sent = None
    if fault.sig is not None and proc.poll() is not None:
        missed = time.monotonic() - t0
    elif fault.sig is not None:
        sent = time.time()
        if fault.sig == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(fault.sig)
    watch(proc, seen, end)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, seen, missed, sent
    return proc.wait(), seen, missed, sent


def exit_codes(fault: Fault) -> set[int]:
    """The exit codes a faulted command may end with: 0 (done before the signal, or no signal), 128 + the
    signal's number (one line, as every command answers a stop signal), minus it (SIGKILL; or killed by
    the signal before Python's handlers were in place); anything else (a crash) is not survived."""
    if fault.sig is None:
        return {0} if fault.kind == "hang" else {1, 2}  # a full disk: the one-line error's 2 (or 1)
    return {0, 128 + fault.sig, -fault.sig}


def finished_after(kind: str, out: Path, sent: float) -> bool:
    """Whether a run of the faulted command wrote its summary after the signal was sent (wall-clock): a
    command that exits 0 after a signal must have finished before it (or, on Flower, while cleaning up)."""
    summaries = [run / "summary.json" for run in run_folders(kind, out)]
    return any(path.is_file() and path.stat().st_mtime > sent for path in summaries)


def recover(kind: str, out: Path, argv: list[str], log: Path) -> int:
    """The documented recovery of a faulted command; its exit code (0: recovered)."""
    if kind == "hang":  # none: the run finishes without the hung client
        return 0
    if kind == "sweep" or not (out / "config.yaml").is_file():  # a sweep, or a run that had not started
        proc = start(argv, log)
    else:
        proc = start(fedpcd("run", "--quiet", "--resume", str(out)), log)
    return proc.wait()


def left_processes(pids: set[int], timeout: float = 10.0) -> list[int]:
    """Those of ``pids`` still running after ``timeout`` s (zombies count as gone)."""
    end = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.2)


def check(kind: str, out: Path, reference: Path, pids: set[int], log: Path) -> tuple[list[str], bool]:
    """(the problems found, whether metrics were lost) after the recovery of a fault."""
    problems, lost = [], False
    text = log.read_text(errors="replace")
    if "Traceback" in text:  # every failure is one line
        last = [
            line for line in text.split("Traceback", 1)[1].splitlines() if line and not line.startswith(" ")
        ]
        problems.append(f"a traceback in {log} ({last[-1] if last else '?'})")
    last = -1 if kind == "hang" else None  # a hung client's last round is without it: not the reference's
    for run, ref in zip(run_folders(kind, out), run_folders(kind, reference), strict=True):
        try:
            mine, theirs = records(run), records(ref)
            if mine[:last] != theirs[:last] or len(mine) != len(theirs):
                problems.append(f"{run.name}: metrics.jsonl differs from the reference")
                lost = True
            if csv_rows(run)[:last] != csv_rows(ref)[:last]:
                problems.append(f"{run.name}: metrics.csv differs from the reference")
            if not (run / "summary.json").is_file():
                problems.append(f"{run.name}: no summary.json")
                lost = True
        except OSError as exc:
            problems.append(f"{run.name}: {exc.strerror}: {exc.filename}")
            lost = True
    temps = [str(p.relative_to(out)) for p in out.rglob("*.tmp")]
    if temps:
        problems.append(f"temp files left: {', '.join(temps[:3])}")
    alive = left_processes(pids)
    if alive:
        problems.append(f"processes left: {alive[:5]}")
    return problems, lost


def describe(fault: Fault) -> str:
    if fault.kind == "hang":
        return f"client 0 never answers in the last round (round timeout {HANG_TIMEOUT_S} s)"
    if fault.sig is None:
        return f"files <= {fault.disk} bytes"
    return f"{signal.Signals(fault.sig).name} at {fault.at:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=30, help="faults to inject (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults' kinds, signals and times")
    parser.add_argument("--dataset", choices=sorted(DATA), default="fmnist")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated kinds to draw (default: {','.join(KINDS)})"
    )
    parser.add_argument("--out", help="folder for the runs (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"unknown kind(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory(prefix="fedpcd-chaos-") as scratch:
        root = Path(args.out or scratch)
        root.mkdir(parents=True, exist_ok=True)
        return chaos(root, args.faults, random.Random(args.seed), DATA[args.dataset], kinds)


REFERENCE = {"disk": "run", "hang": "flower"}  # a fault's reference: the uninterrupted run of this kind


def chaos(root: Path, faults: int, rng: random.Random, data: list[str], kinds: list[str]) -> int:
    unit = math.gcd(*(KINDS[k] for k in kinds))  # kinds of equal weight: one draw each, as rng.choice(kinds)
    plan = [rng.choice([k for k in kinds for _ in range(KINDS[k] // unit)]) for _ in range(faults)]
    references, seconds = {}, {}
    for kind in dict.fromkeys(REFERENCE.get(k, k) for k in plan):
        ref = root / f"reference-{kind}"
        t0 = time.monotonic()
        if subprocess.run(command(kind, ref, data), capture_output=True).returncode != 0:
            print(f"the reference {kind} failed: see {ref}", file=sys.stderr)
            return 1
        references[kind], seconds[kind] = ref, time.monotonic() - t0
    env = None
    if "hang" in plan:
        site = hang_plugin(root / "hang-plugin")
        paths = [os.environ.get("PYTHONPATH", ""), str(site)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    survived = lost = 0
    attempts = iter(range(1, 10**6))
    for i, kind in enumerate(plan, 1):
        like = REFERENCE.get(kind, kind)
        hit = False
        while not hit:  # a fault that hit nothing is drawn again
            at = rng.uniform(0.1, 1.0) * seconds[like]
            if kind == "disk":
                fault = Fault(kind, None, at, int(math.exp(rng.uniform(*map(math.log, DISK_LIMITS)))))
            elif kind == "hang":
                fault = Fault(kind, None, 0.0)
            else:
                fault = Fault(kind, rng.choice(SIGNALS), at)
            out = root / f"fault{next(attempts):03d}-{kind}"
            argv = command(kind, out, data)
            log = out.with_name(f"{out.name}.log")
            code, pids, missed, sent = inject(fault, argv, log, env if kind == "hang" else None)
            if missed is not None:
                why = f"the command ended at {missed:.1f} s"
                seconds[like] = min(seconds[like], missed)  # the reference's time may include a cold start
            elif kind == "disk" and code == 0:
                why = "no file reached the size limit"
            else:
                hit = True
                continue
            print(f"fault {i}/{faults}: {kind}, {describe(fault)}: missed ({why}); drawn again", flush=True)
        unanswered = code == 0 and sent is not None and finished_after(kind, out, sent)
        recovered = recover(kind, out, argv, log)
        problems, lost_here = check(kind, out, references[like], pids, log)
        if code is None:
            problems.insert(0, f"still running after {LIMIT_S:.0f} s: killed")
        elif code not in exit_codes(fault):
            problems.insert(0, f"exited with {code} (see {log})")
        elif unanswered:
            problems.insert(0, f"the signal went unanswered: the run finished after it (see {log})")
        if recovered != 0:
            problems.insert(0, f"recovery exited with {recovered} (see {log})")
            lost_here = True
        what = describe(fault)
        print(
            f"fault {i}/{faults}: {kind}, {what}: exit {code}; {'; '.join(problems) or 'recovered'}",
            flush=True,
        )
        survived += not problems
        lost += lost_here
    print(f"faults injected: {faults}, survived: {survived}, data lost: {lost}")
    return 0 if survived == faults and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
