"""Every random stream of a run, named in one place.

Each stream is a seed derived from the run's seed (``config.seed``) and the stream's own integers by
:func:`derive_seed`, so it is the same in every process and on every backend, and no stream depends on how
many draws another took. Only :func:`global_generator` seeds torch's global generator, once, at a fresh
run's start; nothing else here or in its users touches torch's or numpy's global generator.

The integers are part of every archived result: changing one changes the numbers of the runs that use it.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client id, ...): stable across processes and backends."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (one of the streams below)."""
    return torch.Generator().manual_seed(seed)


# ----- the engine ------------------------------------------------------------------------------------------


def initial_model(seed: int) -> int:
    """The initial weights of every client architecture's model (rounds use 1..R, this stream -1)."""
    return derive_seed(seed, -1)


def global_generator(seed: int) -> int:
    """torch's global generator at a fresh run's start (a resume restores it from the checkpoint): the one
    draw from it is dropout's masks (Wide-ResNet, EfficientNet), so two runs in one process agree."""
    return derive_seed(seed, -2)


def participants(seed: int, rnd: int) -> int:
    """The choice of round ``rnd``'s participants (numpy's ``default_rng``)."""
    return derive_seed(seed, rnd, 0x5A)


def client_update(seed: int, rnd: int, client: int) -> int:
    """Client ``client``'s local update in round ``rnd``: its batches, augmentation and the method's draws."""
    return derive_seed(seed, rnd, client)


def dp_noise(seed: int, rnd: int) -> int:
    """The server's Gaussian noise of round ``rnd`` under differential privacy."""
    return derive_seed(seed, rnd, 0xD9)


def dp_upload_noise(seed: int, rnd: int, client: int) -> int:
    """The noise on client ``client``'s class statistics in round ``rnd`` under differential privacy."""
    return derive_seed(seed, rnd, client, 0xDA)


def secagg_rounding(seed: int, rnd: int, client: int) -> int:
    """Client ``client``'s stochastic rounding under SecAgg+ in round ``rnd``."""
    return derive_seed(seed, rnd, client, 0x5A)


# ----- the algorithms --------------------------------------------------------------------------------------


def creff_features(seed: int) -> int:
    """CReFF's federated features, initialised N(0, 1)."""
    return derive_seed(seed, 0xC4EF)


def creff_retrain(seed: int, rnd: int) -> int:
    """CReFF's fresh classifier and its re-training shuffles in round ``rnd``."""
    return derive_seed(seed, 0xC4F0, rnd)


def creff_real_batches(client_seed: int) -> int:
    """CReFF's sampled real batches, from the client generator's seed (``work.rng.initial_seed()``)."""
    return derive_seed(client_seed, 0xC4F1)


def fedetf_etf(seed: int) -> int:
    """FedETF's simplex ETF."""
    return derive_seed(seed, 0xE7F0)


def fedetf_projection(seed: int) -> int:
    """FedETF's projection layer's initial weights."""
    return derive_seed(seed, 0xE7F1)


def fedgela_etf(seed: int) -> int:
    """FedGELA's simplex ETF."""
    return derive_seed(seed, 0xE7F)


def fedgela_projection(seed: int) -> int:
    """FedGELA's projection's initial weights."""
    return derive_seed(seed, 0xE80)


def fedmr_submitters(seed: int) -> int:
    """FedMR's fixed prototype submitters ("FMR")."""
    return derive_seed(seed, 0x464D52)


def fedmr_lite(client_seed: int) -> int:
    """FedMR Lite's sample picks, from the client generator's seed (``work.rng.initial_seed()``)."""
    return derive_seed(client_seed, 0x4C495445)


def fednh_prototypes(seed: int) -> int:
    """FedNH's initial prototypes ("FNH")."""
    return derive_seed(seed, 0x464E48)


def fedproto_prototypes(seed: int) -> int:
    """FedProto's initial U[0, 1) prototypes ("FPT")."""
    return derive_seed(seed, 0x465054)


def fml_shared_model(seed: int) -> int:
    """FML's and FedKD's shared model's initial weights ("FML")."""
    return derive_seed(seed, 0x464D4C)
