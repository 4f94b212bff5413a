"""Differential privacy with fixed clipping (``privacy`` config section), the same on both backends.

DP-FedAvg with fixed clipping (McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018, Algorithm 1; the scheme of Flower's ``DifferentialPrivacyClientSideFixedClipping`` and
``...ServerSideFixedClipping``); docs/privacy.md states the threat model and what is not protected.

1. **Clip** each client's model update Delta_k = w_k - w^t (its reply's ``model`` minus the ``model`` it
   received) to L2 norm at most C: w_k <- w^t + Delta_k * min(1, C / ||Delta_k||_2), over every floating
   tensor of the model (integer buffers such as BatchNorm's step counter are left as they are).
   ``privacy.clipping: client`` clips on the client, before the reply leaves it (in the Flower ClientApp,
   so the server never sees an unclipped update); ``server`` clips on the server before aggregating.
   Both give the same numbers. The reply's sample count becomes 1 at the same place, so the server averages
   the updates with fixed (uniform) weights, as the accounting assumes, and never learns n_k.
2. **Noise**: after aggregating the m kept updates, every floating tensor of the server's ``model`` gets
   Gaussian noise of standard deviation sigma * C / m (sigma = ``privacy.noise_multiplier``), drawn from a
   generator seeded by (seed, round), so a run is reproducible and both backends agree bitwise.
3. **Account**: :func:`dp_epsilon`, the epsilon at ``privacy.delta`` after r rounds, from Google's
   ``dp-accounting`` (its RDP accountant; the ``privacy`` extra installs it).

Uploads beyond the model: an algorithm declares how each of its ``extra_uploads`` is bounded (its ``uploads``,
:class:`fedpcd.algorithms.context.Upload`; the kinds in ``UPLOAD_KINDS``) and :func:`clip_update` and
:func:`noise_uploads` apply the declaration, the same for every algorithm: a ``model``-kind tensor is clipped
with the model (one bound C) and noised on the server's mean with it; per-class ``rows`` (class means,
header rows) are written for all C classes, each row clipped to ``privacy.stats_clip``, and per-class
``counts`` clipped to ``privacy.count_clip`` (L2), then each client's noised on the server (std sigma times
the bound, the algorithm's server rule not being a fixed-weight mean); ``fixed`` weights become 1 and
``classes`` all C classes. Every noised quantity is one Gaussian mechanism of noise multiplier sigma/2 in the
round's one composition (:func:`mechanisms`, :func:`epsilon`). An algorithm with an upload it does not
declare, or whose server keeps state computed from the unnoised updates (its ``extra_server_state``: FedDyn's
h) is refused in one line (:func:`check_privacy`; :func:`clip_update` checks each reply's keys again). The
run records, per evaluated round, ``dp_clipped`` (how many of the round's updates were clipped) and
``dp_epsilon``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedpcd import seeds
from fedpcd.algorithms import ALGORITHMS, Algorithm
from fedpcd.algorithms.context import CLASSES, MODEL, NUM_SAMPLES, TRAIN_LOSS, Upload
from fedpcd.config import Config
from fedpcd.errors import UserError

COVERED = (MODEL, NUM_SAMPLES, TRAIN_LOSS)  # the reply keys the mechanism covers (docs/privacy.md)
INSTALL = "pip install 'fedpcd[privacy]' (Google's dp-accounting)"


@dataclass(frozen=True)
class UploadBounds:
    """What :func:`clip_update` needs beyond C for class-statistic uploads: ``privacy.stats_clip``,
    ``privacy.count_clip`` and the run's number of classes C."""

    stats_clip: float
    count_clip: float
    num_classes: int


def stat_bounds(config: Config, num_classes: int) -> UploadBounds:
    """The run's :class:`UploadBounds`: its ``privacy.stats_clip`` and ``privacy.count_clip``, C classes."""
    return UploadBounds(config.privacy.stats_clip, config.privacy.count_clip, num_classes)


def declared(algorithm_cls: type) -> dict[str, Upload]:
    """The algorithm class's upload declarations (its ``uploads``) by reply key."""
    return {u.key: u for u in getattr(algorithm_cls, "uploads", ())}


def uncovered(algorithm_cls: type) -> str | None:
    """Why the mechanism does not cover what algorithm class ``algorithm_cls`` uploads and aggregates, from
    its declarations (``extra_uploads`` without an ``uploads`` bound, ``extra_server_state``); None: it
    covers it."""
    bounds = declared(algorithm_cls)
    extra = [k for k in getattr(algorithm_cls, "extra_uploads", ()) if k not in bounds]
    if extra:
        why = getattr(algorithm_cls, "unprivatised", "")
        return _uploads(extra) + (f" ({why})" if why else "")
    kept = tuple(getattr(algorithm_cls, "extra_server_state", ()))
    if kept:
        return f"keeps {', '.join(kept)} on the server, computed from the clients' updates before the noise"
    return None


def _uploads(keys: Sequence[str]) -> str:
    return f"also uploads {', '.join(keys)} beyond its model, neither clipped nor noised"


def _refusal(algorithm: str, why: str) -> UserError:
    able = [n for n in ALGORITHMS.names() if not n.startswith("_") and uncovered(ALGORITHMS.get(n)) is None]
    return UserError(
        f"privacy.clip clips and noises the clients' uploads it has bounds for, but algorithm {algorithm!r} "
        f"{why}: set privacy.clip=null or choose one of: {', '.join(able)}"
    )


def mechanisms(algorithm: Any) -> int:
    """The Gaussian mechanisms of one round, each of noise multiplier sigma/2 (docs/privacy.md): the model's
    mean (with its ``model``-kind uploads) where the algorithm uploads a model, and one per ``rows`` or
    ``counts`` upload that ``algorithm.upload_bounds()`` declares (an instance: its hyperparameters may drop
    some)."""
    released = algorithm.upload_bounds()
    return int(type(algorithm).averages_model) + sum(u.kind in ("rows", "counts") for u in released)


def check_privacy(config: Config) -> None:
    """At the start of a run, before any data is loaded: refuse a ``privacy.clip`` run whose algorithm the
    mechanism does not cover (:func:`uncovered`), a ``privacy.delta`` not below 1/clients and, with noise, a
    missing accountant (the ``privacy`` extra)."""
    privacy = config.privacy
    if privacy.clip is None:
        return
    why = uncovered(ALGORITHMS.get(config.algorithm.name))
    if why is not None:
        raise _refusal(config.algorithm.name, why)
    if privacy.noise_multiplier > 0:
        if privacy.delta >= 1 / config.clients:
            raise UserError(
                f"privacy.delta={privacy.delta:g} is not below 1/clients={1 / config.clients:g}: such a "
                f"delta allows publishing a client's data outright; set privacy.delta below it, e.g. "
                f"clients^-1.1={config.clients**-1.1:.3g} (McMahan et al. 2018)"
            )
        _accountant()


def _model_of(obj: Mapping[str, Any], what: str, algorithm: str) -> Mapping[str, torch.Tensor]:
    model = obj.get(MODEL)
    if not isinstance(model, Mapping):
        raise UserError(
            f"privacy.clip needs an algorithm whose {what} holds the model under 'model'; "
            f"{algorithm!r}'s has keys {sorted(obj)}: set privacy.clip=null or choose another algorithm"
        )
    return model


def _scaled(new: Any, old: Any, scale: torch.Tensor) -> Any:
    """``old + (new - old) * scale`` for a tensor or each floating tensor of a mapping."""
    if isinstance(new, torch.Tensor):
        return old + (new - old) * scale
    scaled = {k: _scaled(v, old[k], scale) for k, v in new.items() if torch.is_floating_point(v) and k in old}
    return {**new, **scaled}


def clip_update(
    reply: dict[str, Any],
    payload: Mapping[str, Any],
    clip: float,
    algorithm: str = "the algorithm",
    bounds: UploadBounds | None = None,
) -> tuple[dict[str, Any], bool]:
    """``reply`` with its model update, and its ``model``-kind uploads' updates, clipped together to L2 norm
    ``clip`` (step 1), its class statistics bounded as its algorithm declares (:func:`bound_uploads`), its
    sample count set to 1 (fixed weights), and whether anything was clipped. A reply holding an upload its
    algorithm declares no bound for, or of an algorithm the mechanism does not cover, is a UserError."""
    cls = ALGORITHMS.get(algorithm) if algorithm in ALGORITHMS else None
    why = uncovered(cls) if cls is not None else None
    kinds = declared(cls) if cls is not None else {}
    extra = sorted(set(reply) - set(COVERED) - set(kinds))
    if extra:
        why = _uploads(extra)
    if why is not None:
        raise _refusal(algorithm, why)
    out = {**reply, NUM_SAMPLES: 1}
    joined = [k for k in reply if k in kinds and kinds[k].kind == "model"]
    if MODEL in reply or cls is None or cls.averages_model:
        joined = [MODEL, *joined]
        _model_of(reply, "reply", algorithm)
        _model_of(payload, "payload", algorithm)
    long = False
    diffs = []
    for key in joined:
        new, old = reply[key], payload[key]
        if isinstance(new, torch.Tensor):
            diffs.append(new - old)
        else:
            diffs += [v - old[k] for k, v in new.items() if torch.is_floating_point(v) and k in old]
    if diffs:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in diffs]))
        if norm > clip:
            long = True
            for key in joined:
                out[key] = _scaled(reply[key], payload[key], clip / norm)
    stats = [u for u in kinds.values() if u.key in reply and u.kind != "model"]
    if stats:
        if bounds is None:
            raise ValueError("a reply with class statistics needs their bounds (UploadBounds)")
        out, was_long = bound_uploads(out, stats, bounds)
        long = long or was_long
    return out, long


def _clip_rows(rows: torch.Tensor, bound: float) -> tuple[torch.Tensor, bool]:
    """Each row of ``rows`` (dimension 0) scaled to L2 norm at most ``bound``; whether any was longer."""
    norms = torch.linalg.vector_norm(rows.reshape(len(rows), -1).double(), dim=1)
    scale = torch.clamp(bound / torch.clamp(norms, min=1e-300), max=1.0).to(rows.dtype)
    return rows * scale.view(-1, *[1] * (rows.dim() - 1)), bool((norms > bound).any())


def bound_uploads(
    reply: dict[str, Any], uploads: Sequence[Upload], bounds: UploadBounds
) -> tuple[dict[str, Any], bool]:
    """``reply`` with its class statistics bounded (``UPLOAD_KINDS``): ``rows`` written for all C classes
    (zeros for the classes it does not hold) and each row clipped to ``stats_clip``; ``counts`` written for
    all C classes as floats and clipped, as one vector, to L2 norm ``count_clip``; ``fixed`` set to 1;
    ``classes`` (a class list or a bool mask) set to all C classes. Whether any row or count vector was
    clipped."""
    out, long, c = dict(reply), False, bounds.num_classes
    for u in uploads:
        value = reply[u.key]
        if u.kind in ("rows", "counts"):
            dense = value.to(torch.get_default_dtype())  # one row per class, zero-filled where not held
            if CLASSES in reply:  # the rows of the listed classes
                dense = torch.zeros(c, *value.shape[1:], dtype=dense.dtype, device=value.device)
                dense[reply[CLASSES]] = value.to(dense.dtype)
            if u.kind == "rows":
                out[u.key], clipped = _clip_rows(dense, bounds.stats_clip)
            else:
                out[u.key], clipped = _clip_rows(dense.view(1, -1), bounds.count_clip)
                out[u.key] = out[u.key].view(-1)
            long = long or clipped
        elif u.kind == "fixed":
            out[u.key] = 1
        elif u.kind == "classes":
            whole = torch.ones(c, dtype=torch.bool, device=value.device)
            out[u.key] = whole if value.dtype == torch.bool else torch.arange(c, device=value.device)
    return out, long


def noise_uploads(
    reply: dict[str, Any], uploads: Sequence[Upload], config: Config, rnd: int, client: int, num_classes: int
) -> dict[str, Any]:
    """``reply`` (bounded by :func:`bound_uploads`) with Gaussian noise on each of its ``rows`` uploads (std
    sigma * stats_clip * sqrt(C): the L2 bound of all C rows) and ``counts`` uploads (std sigma * count_clip,
    then clamped at 0), from a generator seeded by (seed, round, client), in declaration order."""
    privacy = config.privacy
    sigma = privacy.noise_multiplier
    noised = [u for u in uploads if u.key in reply and u.kind in ("rows", "counts")]
    if not sigma or privacy.clip is None or not noised:
        return reply
    gen = seeds.generator(seeds.dp_upload_noise(config.seed, rnd, client))
    out = dict(reply)
    for u in noised:
        value = reply[u.key]
        if u.kind == "rows":
            std = sigma * privacy.stats_clip * math.sqrt(num_classes)
        else:
            std = sigma * privacy.count_clip
        noisy = value + (torch.randn(value.shape, generator=gen, dtype=value.dtype) * std).to(value.device)
        out[u.key] = noisy if u.kind == "rows" else noisy.clamp(min=0.0)
    return out


def add_noise(
    server: dict[str, Any],
    config: Config,
    rnd: int,
    kept: int,
    joined: Sequence[str] = (),
    model: bool = True,
) -> dict[str, Any]:
    """``server`` with Gaussian noise of std ``noise_multiplier * clip / kept`` on its model (step 2; not
    with ``model`` false: an algorithm that averages none, FedSSA), then on each ``joined`` key (the
    ``model``-kind uploads' server values, clipped with the model), from one generator."""
    sigma = config.privacy.noise_multiplier
    if not sigma or config.privacy.clip is None or kept == 0:
        return server
    std = sigma * config.privacy.clip / kept
    state = _model_of(server, "server state", config.algorithm.name) if model else None
    gen = seeds.generator(seeds.dp_noise(config.seed, rnd))

    def noisy(v: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(v):
            return v
        return v + (torch.randn(v.shape, generator=gen, dtype=v.dtype) * std).to(v.device)

    out = dict(server)
    if state is not None:
        out[MODEL] = {k: noisy(v) for k, v in state.items()}  # the state dict's order: every backend agrees
    for key in joined:
        value = server[key]
        tensors = value if isinstance(value, Mapping) else {key: value}
        noised = {k: noisy(v) for k, v in tensors.items()}
        out[key] = noised if isinstance(value, Mapping) else noised[key]
    return out


def _accountant() -> Any:
    """The ``dp_accounting`` module, or a UserError saying how to install it."""
    try:
        import dp_accounting
    except ImportError:
        raise UserError(
            f"privacy.noise_multiplier > 0 reports the privacy spent (dp_epsilon), which needs {INSTALL}"
        ) from None
    return dp_accounting


@functools.lru_cache(maxsize=8)
def _round_rdp(
    clients: int, sampled: int, noise_multiplier: float, mechanisms: int = 1
) -> tuple[tuple[float, ...], np.ndarray]:
    """(RDP orders, the RDP of one round at each): the round is ``mechanisms`` Gaussian sum queries on
    ``sampled`` of ``clients`` clients drawn without replacement; under the replace-one-client relation a sum
    of quantities clipped to a bound B moves by up to 2B, so the noise std sigma*B is sigma/2 sensitivities
    (the model's mean: B = C; a client's class statistic, noised on its own: its L2 bound, the same ratio)."""
    dpa = _accountant()
    orders = tuple(dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    accountant = dpa.rdp.RdpAccountant(orders, dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.GaussianDpEvent(noise_multiplier / 2)
    if mechanisms > 1:  # all released in the same round, by the same sampled clients: one composition
        event = dpa.ComposedDpEvent([event] * mechanisms)
    try:
        with np.errstate(invalid="ignore"):  # a NaN (handled below) is no warning
            accountant.compose(dpa.SampledWithoutReplacementDpEvent(clients, sampled, event))
    except ArithmeticError:  # a noise multiplier so small (< ~1e-150) that sigma^2 underflows: no bound
        return orders, np.full(len(orders), np.inf)
    # r rounds compose to r times one round's RDP (what compose(event, r) computes): one round's is kept
    # (the accountant's _rdp) so each evaluated round costs no new subsampled-RDP computation (~0.3 s);
    # an order whose RDP the library could not compute (NaN) bounds nothing
    rdp = np.array(accountant._rdp, dtype=float)
    return orders, np.where(np.isnan(rdp), np.inf, rdp)


def epsilon(
    clients: int, sampled: int, noise_multiplier: float, rounds: int, delta: float, mechanisms: int = 1
) -> float:
    """The epsilon of (epsilon, ``delta``)-DP after ``rounds`` rounds of DP-FedAvg (user level, replace one
    client) with ``sampled`` of ``clients`` clients per round drawn without replacement, noise multiplier
    sigma and ``mechanisms`` Gaussian mechanisms per round (:func:`mechanisms`): dp-accounting's RDP
    accountant (Wang, Balle & Kasiviswanathan, AISTATS 2019, Theorem 27 for the sampling; its RDP-to-DP
    conversion)."""
    dpa = _accountant()
    orders, rdp = _round_rdp(clients, sampled, noise_multiplier, mechanisms)
    return float(dpa.rdp.compute_epsilon(orders, rdp * rounds, delta)[0])


def dp_epsilon(config: Config, rounds: int, sampled: int, algorithm: Algorithm) -> float | None:
    """``dp_epsilon`` of a run's record after ``rounds`` rounds: :func:`epsilon` for the run's clients with
    ``sampled`` of them per round, ``privacy.noise_multiplier``, ``privacy.delta`` and the :func:`mechanisms`
    of the run's ``algorithm``; None without noise (no guarantee). Finite: the config takes no noise
    multiplier below float32's smallest, 1.4e-45 (``check_values``)."""
    privacy = config.privacy
    if privacy.clip is None or not privacy.noise_multiplier:
        return None
    count = mechanisms(algorithm)
    return epsilon(config.clients, sampled, privacy.noise_multiplier, rounds, privacy.delta, count)


MODEL_ROW = "update clipped to L2 norm C (with its model-kind uploads); noise std sigma*C/m on the mean of m"


def coverage_table() -> str:
    """docs/privacy.md's table, from the declarations: per registered algorithm, each upload beyond
    ``num_samples`` and ``train_loss`` (always 1 and a diagnostic) and how it is bounded and noised, or
    why the algorithm is refused."""
    from fedpcd.algorithms.context import UPLOAD_KINDS

    lines = ["| algorithm | upload | what it is | bound and noise under privacy.clip |", "|---|---|---|---|"]
    for name in ALGORITHMS.names():
        if name.startswith("_"):
            continue
        cls = ALGORITHMS.get(name)
        why = uncovered(cls)
        if why is not None:
            lines.append(f"| {name} | - | - | refused: {why} |")
            continue
        if cls.averages_model:
            lines.append(f"| {name} | model | the model's shared tensors | {MODEL_ROW} |")
        for u in cls.uploads:
            lines.append(f"| {name} | {u.key} | {u.note} | {u.kind}: {UPLOAD_KINDS[u.kind]} |")
    return "\n".join(lines)
