"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1): local SGD, then a sample-weighted model average."""

from __future__ import annotations

from dataclasses import dataclass

from fedpcd.algorithms.contract import ALGORITHMS, Algorithm
from fedpcd.algorithms.vectorizable import Vectorizable


@ALGORITHMS.register("fedavg")
@dataclass
class FedAvg(Algorithm, Vectorizable):
    """FedAvg: clients run E epochs of SGD from the global model (``train_loop``); the server averages all
    state by n_k. It is the contract's defaults as they are, trainable by the vectorized executor; most
    methods are FedAvg plus a change and subclass it."""
