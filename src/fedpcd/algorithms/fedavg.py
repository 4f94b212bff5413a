"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1): local SGD, then a sample-weighted model average."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedpcd.algorithms.contract import ALGORITHMS, Algorithm
from fedpcd.algorithms.vectorizable import Vectorizable
from fedpcd.params import Preset

# FedOpt's setting (Reddi et al., ICLR 2021, Sec. 5; the appendix's tuned learning rates): the server's step
# on the mean update is the method, tuned per task, so the federation and budget stay the experiment's own
_FEDOPT_UNSET = {
    "rounds": "the server optimiser is the method; the experiment's budget applies (Reddi et al. tune its "
    "learning rate per task: 1500 rounds on EMNIST CR)",
    "clients": "the experiment's federation applies (Reddi et al.: 10 clients per round on every task)",
    "participation": "the experiment's federation applies (see clients)",
    "local.epochs": "the clients' training is FedAvg's (Reddi et al.: E = 1)",
    "model.name": "any model (Reddi et al.'s EMNIST CR model is a two-convolution CNN)",
}


@ALGORITHMS.register("fedavg")
@dataclass
class FedAvg(Algorithm, Vectorizable):
    """FedAvg: clients run E epochs of SGD from the global model (``train_loop``); the server averages all
    state by n_k. It is the contract's defaults as they are, trainable by the vectorized executor; most
    methods are FedAvg plus a change and subclass it.

    Presets ``fedavgm`` and ``fedadam``: FedAvg with the server optimiser of FedAvgM (Hsu, Qi & Brown, 2019:
    v <- beta v + Delta, w <- w + eta v) or FedAdam (Reddi et al., ICLR 2021, Algorithm 2), at the server
    learning rate eta and adaptivity tau that Reddi et al.'s grid found best on EMNIST character recognition
    (their appendix: eta = 10^-0.5 with beta = 0.9; eta = 10^-2.5, tau = 10^-4, beta1 = 0.9, beta2 = 0.99)."""

    presets: ClassVar[dict[str, Preset]] = {
        "fedavgm": Preset(
            "FedAvgM: server momentum 0.9 at server lr 10^-0.5 (Reddi et al.'s best on EMNIST CR)",
            {"server.optimizer": "momentum", "server.lr": 10**-0.5, "server.momentum": 0.9},
            _FEDOPT_UNSET,
        ),
        "fedadam": Preset(
            "FedAdam: server Adam at lr 10^-2.5, tau 1e-4, beta1 0.9, beta2 0.99 (Reddi et al.'s best on "
            "EMNIST CR)",
            {
                "server.optimizer": "adam",
                "server.lr": 10**-2.5,
                "server.tau": 1.0e-4,
                "server.beta1": 0.9,
                "server.beta2": 0.99,
            },
            _FEDOPT_UNSET,
        ),
    }
