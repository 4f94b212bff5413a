"""Training throughput of the executors against a plain PyTorch loop.

In one process, with one torch thread (``--threads``), for each setting (model, clients, clients per round):

- plain: a hand-written loop training the same model class on the same samples (the union of the round's
  participants' samples, one shuffled pass, the same batch size and SGD settings): the reference;
- sequential / vectorized: one FedAvg round through the engine's executor seam,
  ``fedpcd.engine.executor.LocalExecutor`` with ``engine.executor`` set in the config, plus ``aggregate``
  (no evaluation). ``vectorized`` is "n/a" while the config rejects it or ``fedpcd.engine.vectorized`` is
  missing.

The three run alternately, ``--repeats`` times after one untimed warm-up pass (on at most 10 of the
participants); each throughput is samples trained / median seconds, and the ratios are to the plain loop
*of the same run* (absolute numbers on a shared machine are noise). Peak RSS is the process's
(``ru_maxrss``, so far) after the setting; with full participation it includes every participant's reply
(FedAvg's aggregate takes the list: 100 resnet18 replies are ~4.5 GB). Holding them costs time too: on the
2-core VM the first touch of fresh memory is slow (~120 ms per 45 MB reply beyond ~1.5 GB), so sequential
resnet18 with 50-100 clients per round of 4 samples measures ~0.55x, ~0.7x once the process had touched
that much memory before; a plain loop never holds more than one model.
An end-to-end line adds personal evaluation every round (``LocalExecutor.train(..., evaluate=True)``) and the
global accuracy, against the same plain loop (training only: the target's reference); the line under it gives
the ratios against a plain loop that also evaluates the same samples (:meth:`PlainLoop.evaluate`).

Settings: simplecnn on fmnist (``--samples`` per client, default 320 = 5 batches of 64, 3 repeats) and
resnet18 on synthetic 3x32x32 data (default 4 samples per client in one batch, 1 repeat: resnet18 trains
~10-15 samples/s on one loaded CPU thread);
clients 10, 50, 100, all of them or 10 per round; iid partition, every client trimmed to exactly
``samples`` so that federated and plain batches are the same. Targets (ratios to the plain loop):
sequential >= 0.9; vectorized >= 1.8 with 10 simplecnn clients per round, >= 3 with 50 or more;
end-to-end >= 1.4 (vectorized; once batched personal evaluation lands): FedAvg, simplecnn, fmnist,
10 clients x 1200 samples, personal evaluation (``--e2e-test``, default ``split``) and GA every round.
A last line (simplecnn, not ``--quick``) prints Amdahl's bound for any exact executor: the time of the
convolution kernels a training step must run against a whole plain step (:func:`convolution_floor`).
The full benchmark takes ~6-8 minutes on a loaded 2-core machine; ``--quick`` a few seconds.

    python benchmarks/speed.py [--quick] [--models simplecnn resnet18] [--clients 10 50 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import queue
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedpcd.config import Config
from fedpcd.data.datasets import DATASETS
from fedpcd.data.tensors import Dataset
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import Federation, build_federation, global_accuracy, sample_clients
from fedpcd.engine.tasks import payloads_for
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

EXECUTORS = ("sequential", "vectorized")
TARGET_SEQ = 0.9
TARGET_VEC_10 = 1.8
TARGET_VEC_50 = 3.0
TARGET_E2E = 1.4


# ----- data ---------------------------------------------------------------------------------------------


def _synthetic32(root: Any = None, download: bool = True) -> Dataset:
    """10 classes of 3x32x32 images: a fixed random 8x8x3 pattern per class, upscaled 4x, plus noise."""
    rng = np.random.default_rng(321)
    templates = np.kron(rng.random((10, 3, 8, 8)) < 0.5, np.ones((1, 1, 4, 4), dtype=bool))

    def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rng.permutation(np.repeat(np.arange(10), n // 10))
        x = np.where(templates[y], 170.0, 70.0) + rng.normal(0.0, 40.0, size=(len(y), 3, 32, 32))
        return torch.from_numpy(np.clip(x, 0, 255).astype(np.uint8)), torch.from_numpy(y.astype(np.int64))

    (train_x, train_y), (test_x, test_y) = split(2000), split(500)
    return Dataset("synthetic32", train_x, train_y, test_x, test_y, 10, (0.47,) * 3, (0.25,) * 3)


def register_synthetic32() -> None:
    """Make ``dataset.name=synthetic32`` known in this process (benchmark-only data, no files)."""
    if "synthetic32" not in DATASETS:
        DATASETS.register("synthetic32")(_synthetic32)


# ----- settings -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One row of the table: ``per_round`` participants out of ``clients`` (None: all of them)."""

    model: str
    dataset: str
    clients: int
    per_round: int | None
    samples: int  # per client
    batch_size: int
    dataset_size: int  # training samples available (to size train_fraction)
    repeats: int = 3

    @property
    def participants(self) -> int:
        return self.clients if self.per_round is None else min(self.per_round, self.clients)

    def label(self) -> str:
        return f"{self.model}/{self.dataset}"


MODEL_DEFAULTS = {  # model -> (dataset, samples per client, batch size, training set size, repeats)
    "simplecnn": ("fmnist", 320, 64, 60000, 3),
    "resnet18": ("synthetic32", 4, 4, 2000, 1),  # ~10-15 samples/s on one loaded CPU thread
}
QUICK_DEFAULTS = {
    "simplecnn": ("synthetic16", 20, 10, 1000, 1),
    "resnet18": ("synthetic16", 2, 2, 1000, 1),  # 1x16x16: a smoke test, not a measurement
}
WARMUP_CLIENTS = 10  # the untimed first pass trains at most this many of the round's participants


def settings_for(
    models: Sequence[str],
    clients: Sequence[int],
    per_round: Sequence[int | None],
    quick: bool,
    samples: int | None,
    repeats: int | None,
) -> list[Setting]:
    """The table's settings; a partial-participation row is left out where it equals full participation."""
    table = QUICK_DEFAULTS if quick else MODEL_DEFAULTS
    out = []
    for model in models:
        dataset, n, batch, size, reps = table[model]
        n = samples or n
        for k in clients:
            for m in per_round:
                if m is not None and (m >= k or (quick and model == "resnet18")):
                    continue  # equals full participation; quick: resnet18 once only
                if k * n > size:
                    raise SystemExit(f"{model}: {k} clients x {n} samples exceed the {size} training samples")
                out.append(Setting(model, dataset, k, m, n, min(batch, n), size, repeats or reps))
    return out


def config_for(setting: Setting, executor: str, **extra: Any) -> Config | None:
    """The FedAvg config of a setting driven by ``executor`` (None when the config rejects it)."""
    fraction = min(1.0, setting.clients * setting.samples * 1.05 / setting.dataset_size + 0.001)
    overrides = [
        f"dataset.name={setting.dataset}",
        f"dataset.train_fraction={fraction:.6f}",
        f"model.name={setting.model}",
        "partition.scheme=iid",
        f"clients={setting.clients}",
        f"participation={setting.participants / setting.clients}",
        f"local.batch_size={setting.batch_size}",
        "local.epochs=1",
        "algorithm.name=fedavg",
        f"engine.executor={executor}",
        "output_dir=/dev/null",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    try:
        return load_config(None, overrides)
    except UserError:
        return None


def vectorized_available() -> bool:
    """Whether the vectorised executor exists (until it does, the engine would run the sequential one)."""
    return importlib.util.find_spec("fedpcd.engine.vectorized") is not None


# ----- measurement --------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs them asynchronously): a timer then sees their time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FederatedRunner:
    """One executor's FedAvg federation over a shared set of clients: times one round."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.algorithm = fed.new_algorithm()
        self.server = self.algorithm.init_server(fed.model_for(0, fresh=True))
        self.states: dict[int, Any] = {}

    def round(self, rnd: int, ids: list[int], evaluate: bool = False) -> float:
        t0 = time.perf_counter()
        executor = LocalExecutor(self.fed, states=self.states)
        results = executor.train(
            self.algorithm, payloads_for(self.algorithm, self.server, ids), rnd, evaluate
        )
        self.server = self.algorithm.aggregate(self.server, [r.update for r in results])
        if evaluate:
            global_accuracy(self.algorithm, self.fed.model_for(0), self.fed, self.server)
        synchronize(self.fed.device)
        return time.perf_counter() - t0


class PlainLoop:
    """The reference: the same model class trained by a hand-written loop on in-memory tensors."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.model = fed.new_model()
        self.x, self.y = fed.clients[0].x, fed.clients[0].y

    def round(self, rnd: int, ids: list[int]) -> float:
        cfg = self.fed.config.local
        t0 = time.perf_counter()
        idx = torch.cat([self.fed.clients[k].train_idx for k in ids])
        opt = torch.optim.SGD(
            self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        self.model.train()
        g = torch.Generator().manual_seed(rnd)
        order = idx[torch.randperm(len(idx), generator=g).to(idx.device)]
        for start in range(0, len(order), cfg.batch_size):
            b = order[start : start + cfg.batch_size]
            loss = F.cross_entropy(self.model(self.x[b]), self.y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        synchronize(self.fed.device)
        return time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(self, ids: list[int]) -> float:
        """The evaluation a plain loop would run after its round, timed: the model on each participant's
        local test split (or the full test set, with ``personal_test: full``), then on the full test set,
        in eval mode, batches of 512, stock layers."""
        t0 = time.perf_counter()
        self.model.eval()
        test_x = self.fed.clients[0].test_x
        full = self.fed.config.personal_test == "full"
        for x in [test_x if full else test_x[self.fed.clients[k].local_test_idx] for k in ids] + [test_x]:
            for start in range(0, len(x), 512):
                self.model(x[start : start + 512]).argmax(1)
        self.model.train()
        synchronize(self.fed.device)
        return time.perf_counter() - t0


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(setting: Setting, **extra: Any) -> tuple[Federation, dict[str, Federation | None]]:
    """The sequential federation (clients trimmed to exactly ``samples``) and one per executor sharing it."""
    base = config_for(setting, "sequential", **extra)
    assert base is not None
    fed = build_federation(base)
    for client in fed.clients:
        if client.num_samples < setting.samples:
            raise SystemExit(f"client {client.id} has {client.num_samples} < {setting.samples} samples")
        client.train_idx = client.train_idx[: setting.samples]
    feds: dict[str, Federation | None] = {"sequential": fed}
    vec = config_for(setting, "vectorized", **extra) if vectorized_available() else None
    feds["vectorized"] = dataclasses.replace(fed, config=vec, _models={}) if vec is not None else None
    return fed, feds


def measure(setting: Setting, evaluate: bool = False, **extra: Any) -> dict[str, Any]:
    """Samples/s of plain, sequential and vectorized for one setting (median over its ``repeats``)."""
    fed, feds = build(setting, **extra)
    plain = PlainLoop(fed)
    runners = {name: FederatedRunner(f) for name, f in feds.items() if f is not None}
    times: dict[str, list[float]] = {"plain": [], **{name: [] for name in runners}}
    if evaluate:
        times["plain_eval"] = []
    samples = setting.participants * setting.samples
    for rep in range(setting.repeats + 1):  # pass 0 warms every path up and is not counted
        rnd = rep + 1
        ids = sample_clients(setting.clients, setting.participants, fed.config.seed, rnd)
        assert len(ids) == setting.participants
        if rep == 0:
            ids = ids[:WARMUP_CLIENTS]
        t = {"plain": plain.round(rnd, ids)}
        if evaluate:
            t["plain_eval"] = t["plain"] + plain.evaluate(ids)
        for name, runner in runners.items():
            t[name] = runner.round(rnd, ids, evaluate)
        if rep:
            for name, value in t.items():
                times[name].append(value)
    sps = {name: samples / statistics.median(v) for name, v in times.items()}
    row: dict[str, Any] = {
        "model": setting.model,
        "dataset": setting.dataset,
        "clients": setting.clients,
        "per_round": setting.participants,
        "samples_per_client": setting.samples,
        "batch_size": setting.batch_size,
        "samples_per_round": samples,
        "evaluate": evaluate,
        "plain_sps": sps["plain"],
    }
    for name in EXECUTORS:
        row[f"{name}_sps"] = sps.get(name)
        row[f"{name}_ratio"] = sps[name] / sps["plain"] if name in sps else None
        if evaluate:  # against a plain loop that also evaluates the same way (informative, not a target)
            row[f"{name}_ratio_eval"] = sps[name] / sps["plain_eval"] if name in sps else None
    row["peak_rss_mb"] = peak_rss_mb()
    return row


# ----- targets and output -------------------------------------------------------------------------------


def targets_of(row: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(name, ratio key, minimum) of the targets that apply to a row."""
    if row.get("e2e"):
        return [("end-to-end (best executor)", "best_ratio", TARGET_E2E)]
    out = [("sequential", "sequential_ratio", TARGET_SEQ)]
    if row["model"] == "simplecnn":
        if row["per_round"] >= 50:
            out.append(("vectorized", "vectorized_ratio", TARGET_VEC_50))
        elif row["per_round"] >= 10:
            out.append(("vectorized", "vectorized_ratio", TARGET_VEC_10))
    return out


def check(rows: Sequence[dict[str, Any]]) -> tuple[bool, list[str]]:
    """Whether every target is met (n/a counts as not met), and one line per miss."""
    misses = []
    for row in rows:
        for name, key, minimum in targets_of(row):
            value = row.get(key)
            if value is None or value < minimum:
                got = "n/a" if value is None else f"{value:.2f}x"
                where = (
                    "end-to-end" if row.get("e2e") else f"{row['model']} {row['per_round']}/{row['clients']}"
                )
                misses.append(f"{where}: {name} {got} < {minimum}x")
    return not misses, misses


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


HEADER = (
    f"{'model/data':30s} {'clients':>7s} {'/round':>6s} {'samples':>7s} {'plain/s':>8s} {'seq/s':>8s} "
    f"{'vec/s':>8s} {'seq x':>6s} {'vec x':>6s} {'peakRSS':>8s}"
)


def print_row(r: dict[str, Any]) -> None:
    """One table line: throughputs (samples/s), ratios to the plain loop, peak RSS so far."""
    name = f"{r['model']}/{r['dataset']}" + (" e2e" if r.get("e2e") else "")
    print(
        f"{name:30s} {r['clients']:7d} {r['per_round']:6d} {r['samples_per_round']:7d} "
        f"{r['plain_sps']:8.0f} {_fmt(r['sequential_sps'], '8.0f'):>8s} "
        f"{_fmt(r['vectorized_sps'], '8.0f'):>8s} "
        f"{_fmt(r['sequential_ratio'], '6.2f'):>6s} {_fmt(r['vectorized_ratio'], '6.2f'):>6s} "
        f"{r['peak_rss_mb']:7.0f}M",
        flush=True,
    )


def e2e_row(quick: bool, repeats: int | None, personal_test: str) -> dict[str, Any]:
    """FedAvg, simplecnn, 10 clients, every client every round, personal evaluation every round."""
    if quick:
        setting = Setting("simplecnn", "synthetic16", 4, None, 40, 10, 1000, repeats or 1)
    else:
        setting = Setting("simplecnn", "fmnist", 10, None, 1200, 64, 60000, repeats or 3)
    row = measure(setting, evaluate=True, personal_test=personal_test)
    row["e2e"] = True
    row["dataset"] = f"{row['dataset']} test={personal_test}"
    ratios = [row[f"{n}_ratio"] for n in EXECUTORS if row[f"{n}_ratio"] is not None]
    row["best_ratio"] = max(ratios) if ratios and row["vectorized_ratio"] is not None else None
    return row


def _best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def convolution_floor(batch_size: int = 64, repeats: int = 20) -> dict[str, float]:
    """Amdahl's bound for simplecnn on 1x28x28 inputs: the time of one plain training step (forward, backward,
    SGD) and of the convolution kernels any exact executor must run in it (both convolutions forward, their
    weight gradients, the second one's input gradient; each the faster of oneDNN's backward kernel and the
    convolution-of-input-by-output form), so ``step / convs`` caps the speed-up of any executor that keeps
    these kernels and removes everything else."""
    from fedpcd.models import build_model

    model = build_model("simplecnn", 1, 10, 28)
    x = torch.randn(batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (batch_size,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def conv_ms(conv: torch.nn.Conv2d, inp: torch.Tensor, input_grad: bool) -> float:
        w = conv.weight.detach()
        out = F.conv2d(inp, w)
        g = torch.randn_like(out)
        args = (g, inp, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        forward = _best_ms(lambda: F.conv2d(inp, w), repeats)
        onednn = _best_ms(lambda: torch.ops.aten.convolution_backward(*args, [False, True, False]), repeats)
        as_conv = _best_ms(lambda: F.conv2d(inp.transpose(0, 1), g.transpose(0, 1)), repeats)
        data = _best_ms(lambda: torch.ops.aten.convolution_backward(*args, [True, False, False]), repeats)
        return forward + min(onednn, as_conv) + (data if input_grad else 0.0)

    with torch.no_grad():
        hidden = F.max_pool2d(F.relu(model.conv1(x)), 2)
    convs = conv_ms(model.conv1, x, False) + conv_ms(model.conv2, hidden, True)
    return {"step_ms": _best_ms(step, repeats), "conv_ms": convs}


# ----- the side-by-side: worker pool and evaluation, end to end ---------------------------------------------

SIDE_ARGS = [  # FedAvg, Fashion-MNIST, Simple-CNN, 20 clients Dirichlet(0.1), batch 64, 1 local epoch
    "dataset.name=fmnist",
    "model.name=simplecnn",
    "clients=20",
    "partition.scheme=dirichlet",
    "partition.beta=0.1",
    "local.batch_size=64",
    "local.epochs=1",
    "engine.checkpoint_every=0",
]
TARGET_TRAIN_W2, TARGET_E2E_W2, TARGET_VEC_SPLIT_W2, TARGET_MEMORY_W2 = 1.8, 1.75, 2.4, 1.5
TARGET_VEC_TRAIN_W2 = 3.0  # engine.executor: vectorized, workers 2, training only
TARGET_FULL_EVERY_1_W2 = 1.6  # personal_full_every: 1 (the full personal test every round), workers 2
# the end-to-end variants: (executor, personal_test, personal_full_every), named by e2e_name
E2E_VARIANTS = (("sequential", "full", 5), ("sequential", "split", 5), ("vectorized", "split", 5))
E2E_VARIANTS += (("sequential", "full", 1),)


def e2e_name(executor: str, test: str, every: int) -> str:
    """ "e2e sequential full", or with the full personal test every round "e2e sequential full every1"."""
    return f"e2e {executor} {test}" + (f" every{every}" if every != 5 else "")


class PeakMemory:
    """The largest proportional set size (PSS: shared pages split between the processes that map them) of
    this process and its children together, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.25) -> None:
        import psutil

        self.process, self.interval, self.peak = psutil.Process(), interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _pss(self) -> float:
        total = 0.0
        for p in [self.process, *self.process.children(recursive=True)]:
            with contextlib.suppress(Exception):  # a child that just exited
                total += p.memory_full_info().pss
        return total / 2**20

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._pss())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def side_config(fraction: float, rounds: int, out: str, *extra: str) -> Config:
    return load_config(
        None,
        [*SIDE_ARGS, f"dataset.train_fraction={fraction}", f"rounds={rounds}", f"output_dir={out}", *extra],
    )


def train_only(fed: Federation, workers: int, rounds: int, executor: str = "sequential") -> list[float]:
    """Seconds of each of ``rounds`` FedAvg rounds of every client, training and aggregation only, with
    ``workers`` processes (the pool starts in the first), through ``executor`` (``engine.executor``)."""
    fed = dataclasses.replace(
        fed,
        config=fed.config.model_copy(
            update={"engine": fed.config.engine.model_copy(update={"executor": executor})}
        ),
    )
    algorithm = fed.new_algorithm()
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    executor = LocalExecutor(fed, workers, states={})
    times = []
    try:
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            replies = executor.train(
                algorithm, payloads_for(algorithm, server, list(range(len(fed.clients)))), rnd, evaluate=False
            )
            server = algorithm.aggregate(server, [r.update for r in replies])
            times.append(time.perf_counter() - t0)
    finally:
        executor.close()
    return times


def end_to_end(
    fraction: float, rounds: int, workers: int, executor: str, personal_test: str, full_every: int = 5
) -> dict[str, Any]:
    """One local run (evaluation every round; with ``personal_test: full`` the full personal test every
    ``full_every`` rounds and in the last): each round's wall time (the pool starts in the first) and the
    peak memory of its processes."""
    from fedpcd.backends import run_experiment

    with tempfile.TemporaryDirectory() as tmp:
        config = side_config(
            fraction,
            rounds,
            f"{tmp}/run",
            f"engine.workers={workers}",
            f"engine.executor={executor}",
            f"personal_test={personal_test}",
            f"personal_full_every={full_every}",
        )
        with PeakMemory() as memory:
            run_experiment(config, progress=False)
        with open(f"{tmp}/run/metrics.jsonl") as fh:
            walls = [json.loads(line)["wall_s"] for line in fh]
    return {"rounds_s": walls, "peak_pss_mb": memory.peak}


def _plain_in_process(fraction: float, rounds: int, start: Any, results: Any) -> None:
    """One of :func:`plain_parallel`'s processes: the plain loop's rounds, each begun at ``start``."""
    torch.set_num_threads(1)
    fed = build_federation(side_config(fraction, rounds, "unused"))
    plain, ids = PlainLoop(fed), list(range(len(fed.clients)))
    times = []
    for rnd in range(1, rounds + 1):
        start.wait()
        times.append(plain.round(rnd, ids))
    results.put(times)


def plain_parallel(fraction: float, rounds: int, processes: int = 2) -> list[float]:
    """The most ``processes`` processes get from this machine: as many plain loops at once, each in its own
    process on all the clients' samples, every round begun together. Returns the seconds per round's worth of
    samples (a round's wall time, the slowest process's, over ``processes``)."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_plain_in_process, args=(fraction, rounds, start, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    times: list[list[float]] = []
    while len(times) < processes:
        with contextlib.suppress(queue.Empty):
            times.append(results.get(timeout=1))
        if any(w.exitcode for w in workers):  # one failed: the others would wait at the barrier
            start.abort()
            raise RuntimeError("a process of the plain loops in parallel failed (its traceback is above)")
    for worker in workers:
        worker.join()
    return [max(ts) / processes for ts in zip(*times, strict=True)]


def side_by_side(fraction: float, rounds: int, repeats: int, training_only: bool = False) -> dict[str, Any]:
    """The issue's comparison in one process: a plain loop and fedpcd (training only, sequential and
    vectorized, and, unless ``training_only``, end to end with evaluation every round) at 1 and 2 processes
    (the plain loop's "w2": two at once, :func:`plain_parallel`, the machine's ceiling for 2 processes),
    as throughput ratios to the plain loop over all rounds ("all": the workers' start and every process's
    first-round warm-up included) and over rounds 2.. ("steady"), plus peak memory."""
    fed = build_federation(side_config(fraction, rounds, "unused"))
    samples = sum(c.num_samples for c in fed.clients)
    plain = PlainLoop(fed)
    ids = list(range(len(fed.clients)))
    variants: dict[str, Callable[[], list[float]]] = {
        "plain": lambda: [plain.round(r, ids) for r in range(1, rounds + 1)],
        "plain w2": lambda: plain_parallel(fraction, rounds),
        "train w1": lambda: train_only(fed, 1, rounds),
        "train w2": lambda: train_only(fed, 2, rounds),
        "train vectorized w1": lambda: train_only(fed, 1, rounds, "vectorized"),
        "train vectorized w2": lambda: train_only(fed, 2, rounds, "vectorized"),
    }
    memory: dict[str, list[float]] = {}
    for workers in () if training_only else (1, 2):
        for executor, test, every in E2E_VARIANTS:
            name = f"{e2e_name(executor, test, every)} w{workers}"

            def run(
                w: int = workers, e: str = executor, t: str = test, f: int = every, n: str = name
            ) -> list[float]:
                row = end_to_end(fraction, rounds, w, e, t, f)
                memory.setdefault(n, []).append(row["peak_pss_mb"])
                return row["rounds_s"]

            variants[name] = run
    seconds: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(repeats):  # alternating: drifts in the machine's load hit every variant alike
        for name, fn in variants.items():
            seconds[name].append(fn())
    ratios: dict[str, dict[str, float]] = {"all": {}, "steady": {}}
    for part, cut in (("all", 0), ("steady", 1)):
        rate = {
            name: samples * (rounds - cut) / statistics.median(sum(r[cut:]) for r in runs)
            for name, runs in seconds.items()
        }
        ratios[part] = {name: r / rate["plain"] for name, r in rate.items()}
    peak = {name: statistics.median(ms) for name, ms in memory.items()}
    return {
        "samples_per_round": samples,
        "rounds": rounds,
        "ratios": ratios,
        "peak_pss_mb": peak,
        "seconds": seconds,
    }


def amdahl(rate_1: float, rate_2: float, clients_per_round: int = 20) -> dict[str, float]:
    """Amdahl's model fitted to the measured speed-up of 2 processes: the serial fraction s with
    S(2) = 1 / (s + (1 - s) / 2), then S(n) = 1 / (s + (1 - s) / min(n, clients per round)) (a round has no
    more parallel tasks than clients) for n processes on n cores, as speed-ups over 1 process."""
    speedup = rate_2 / rate_1
    serial = min(1.0, max(0.0, 2 / speedup - 1))
    out = {"serial": serial}
    for n in (4, 8, 16):
        out[n] = 1 / (serial + (1 - serial) / min(n, clients_per_round))
    return out


def print_side_by_side(side: dict[str, Any]) -> list[str]:
    """The table, and the targets it misses (on the steady rounds: the start is a one-off cost, shown in the
    "all rounds" columns)."""
    steady, every, peak = side["ratios"]["steady"], side["ratios"]["all"], side["peak_pss_mb"]
    print(
        f"\nside by side: FedAvg, fmnist, simplecnn, 20 clients Dir(0.1), batch 64, 1 epoch, evaluation every"
        f" round, {side['samples_per_round']} samples x {side['rounds']} rounds; throughput / plain loop's"
    )
    print(f"{'':36} {'rounds 2+':>21} {'all rounds':>21} {'peak PSS (MB)':>22}")
    print(f"{'':36} {'w1':>10} {'w2':>10} {'w1':>10} {'w2':>10} {'w1 -> w2':>22}")
    rows = [("plain loop(s), one per process", "plain", None), ("fedpcd training only", "train", None)]
    rows.append(("fedpcd training only, vectorized", "train vectorized", None))
    for executor, test, full_every in E2E_VARIANTS:
        name = e2e_name(executor, test, full_every)
        if f"{name} w1" in steady:
            setting = "full test each round" if full_every == 1 else f"personal_test {test}"
            label = f"e2e {executor}, {setting}"
            rows.append((label, name, test))
    for label, name, _ in rows:
        if name == "plain":
            print(
                f"{label:36} {steady['plain']:>10.2f} {steady['plain w2']:>10.2f} {every['plain']:>10.2f}"
                f" {every['plain w2']:>10.2f}"
            )
            continue
        a, b = f"{name} w1", f"{name} w2"
        mem = f"{peak[a]:.0f} -> {peak[b]:.0f} ({peak[b] / peak[a]:.2f}x)" if a in peak else ""
        print(
            f"{label:36} {steady[a]:>10.2f} {steady[b]:>10.2f} {every[a]:>10.2f} {every[b]:>10.2f} {mem:>22}"
        )
    for name, label in (("train", "training only"), ("e2e sequential full", "end to end, default eval")):
        if f"{name} w1" not in steady:
            continue
        model = amdahl(steady[f"{name} w1"], steady[f"{name} w2"])
        shown = ", ".join(f"{n} cores {model[n]:.1f}x" for n in (4, 8, 16))
        print(f"  model ({label}): serial fraction {model['serial']:.2f} (from 2 processes); {shown}")
    misses = []
    for name, target in (
        ("train w2", TARGET_TRAIN_W2),
        ("train vectorized w2", TARGET_VEC_TRAIN_W2),
        ("e2e sequential full w2", TARGET_E2E_W2),
        ("e2e vectorized split w2", TARGET_VEC_SPLIT_W2),
        ("e2e sequential full every1 w2", TARGET_FULL_EVERY_1_W2),
    ):
        if name in steady and steady[name] < target:
            misses.append(f"{name}: {steady[name]:.2f}x < {target}x")
    if not peak:
        return misses
    mem = peak["e2e sequential full w2"] / peak["e2e sequential full w1"]
    if mem > TARGET_MEMORY_W2:
        misses.append(f"peak memory of workers 2: {mem:.2f}x workers 1 > {TARGET_MEMORY_W2}x")
    return misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes on synthetic data (a smoke test)")
    parser.add_argument(
        "--models",
        nargs="*",
        default=["simplecnn", "resnet18"],
        choices=sorted(MODEL_DEFAULTS),
        help="models of the table (none: the end-to-end line only)",
    )
    parser.add_argument("--clients", nargs="+", type=int, help="default 10 50 100 (quick: 4)")
    parser.add_argument(
        "--per-round", nargs="+", default=["all", "10"], help="participants per round: 'all' and/or numbers"
    )
    parser.add_argument("--samples", type=int, help="samples per client (default: per model, see the doc)")
    parser.add_argument(
        "--repeats", type=int, help="timed passes after a warm-up (default simplecnn 3, resnet18 1, quick 1)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--e2e-test", default="split", choices=["split", "full", "none"], help="personal_test of the e2e line"
    )
    parser.add_argument(
        "--side-by-side",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="first, the worker pool's side-by-side on this fraction of Fashion-MNIST (0: skip it)",
    )
    parser.add_argument("--side-rounds", type=int, default=3, help="rounds of each side-by-side run")
    parser.add_argument(
        "--side-training-only", action="store_true", help="the side-by-side's training-only variants alone"
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    from demo_time import load, machine_report  # beside this file

    head = machine_report(load())
    torch.set_num_threads(args.threads)
    register_synthetic32()
    clients = args.clients or ([4] if args.quick else [10, 50, 100])
    per_round = [None if p == "all" else (2 if args.quick else int(p)) for p in args.per_round]
    t0 = time.perf_counter()
    print(
        f"fedpcd speed benchmark: FedAvg, 1 local epoch, {args.threads} torch thread(s); vectorized executor "
        f"{'available' if vectorized_available() else 'n/a (fedpcd.engine.vectorized missing)'}",
        flush=True,
    )
    side, side_misses = None, []
    if args.side_by_side > 0 and not args.quick:
        side = side_by_side(args.side_by_side, args.side_rounds, args.repeats or 2, args.side_training_only)
        side_misses = print_side_by_side(side)
        print(flush=True)
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows: list[dict[str, Any]] = []
    for setting in settings_for(args.models, clients, per_round, args.quick, args.samples, args.repeats):
        rows.append(measure(setting))
        print_row(rows[-1])
    if args.e2e_test != "none":
        rows.append(e2e_row(args.quick, args.repeats, args.e2e_test))
        print_row(rows[-1])
        seq, vec = (_fmt(rows[-1][f"{n}_ratio_eval"], ".2f") for n in EXECUTORS)
        print(f"  e2e against a plain loop that also evaluates: sequential {seq}x, vectorized {vec}x")
    if "simplecnn" in args.models and not args.quick:
        step, convs = convolution_floor().values()
        print(
            f"\nconvolution floor (simplecnn, batch 64): {convs:.2f} of a {step:.2f} ms plain step; "
            f"no exact executor on these kernels exceeds {step / convs:.2f}x"
        )
    ok, misses = check(rows)
    misses += side_misses
    ok = ok and not side_misses
    print(f"\npeak RSS {peak_rss_mb():.0f} MB; {time.perf_counter() - t0:.0f} s")
    print(
        f"targets: sequential >= {TARGET_SEQ}x; vectorized >= {TARGET_VEC_10}x (10 simplecnn clients/round), "
        f">= {TARGET_VEC_50}x (50+); end-to-end >= {TARGET_E2E}x"
    )
    for miss in misses:
        print(f"  missed: {miss}")
    print("overall: " + ("PASS" if ok else "FAIL"))
    if args.json:
        with open(args.json, "w") as fh:
            report = {**head, "load_after": load(), "rows": rows, "side_by_side": side}
            json.dump({**report, "pass": ok, "misses": misses}, fh, indent=2)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
