"""``aggregation.robust``: a Byzantine-robust mean of the model updates in place of the algorithm's own.

For algorithms that aggregate as FedAvg does (their server's only aggregate is the mean of the clients'
models), the server takes the coordinate-wise median or the coordinate-wise trimmed mean of the kept
replies' models (Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018, Defs. 1-2), unweighted: a
client cannot buy influence with its sample count. What it bounds: a minority of clients sending
well-formed, finite but arbitrary models moves each coordinate at most to the range of the honest values.
What it does not: a majority of such clients, or poisoning too small per coordinate to be trimmed.
"""

from __future__ import annotations

from typing import Any

from fedpcd.algorithms import fedavg_aggregating
from fedpcd.algorithms.base import MODEL, coordinate_median, trimmed_mean
from fedpcd.config import Config
from fedpcd.errors import UserError


def check_robust(config: Config) -> None:
    """At the start of a run: ``aggregation.robust`` needs an algorithm that aggregates as FedAvg does, and
    neither SecAgg+ (the server sees only the mean) nor DP noise (calibrated for the mean)."""
    robust = config.aggregation.robust
    if robust == "none":
        return
    name = config.algorithm.name
    if name not in fedavg_aggregating():
        raise UserError(
            f"aggregation.robust={robust} replaces FedAvg's mean, but algorithm {name!r} aggregates its own "
            f"way; use it with one of: {', '.join(fedavg_aggregating())}, or set aggregation.robust=none"
        )
    if config.privacy.secagg is not None or config.privacy.noise_multiplier > 0:
        raise UserError(
            f"aggregation.robust={robust} needs every update on the server and the plain mean's sensitivity; "
            "it does not combine with privacy.secagg or privacy.noise_multiplier > 0"
        )


def robust_aggregate(config: Config, server: dict[str, Any], replies: list[dict[str, Any]]) -> dict[str, Any]:
    """The server state with its model the robust mean of the replies' models."""
    models = [reply[MODEL] for reply in replies]
    if config.aggregation.robust == "median":
        server[MODEL] = coordinate_median(models)
    else:
        server[MODEL] = trimmed_mean(models, config.aggregation.trim)
    return server
