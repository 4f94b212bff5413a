"""Class-mean geometry of a finished run: the angles FedGELA's paper plots (Fig. 2, 3a-b, 5).

For a feature map h(x) and the full test set, mu_c is the mean feature of class c's test samples. Angles are
taken between the centred means mu_c - mean_c' mu_c' (the neural-collapse convention: a simplex ETF has every
pairwise angle arccos(-1/(C-1)), 96.4 degrees for C = 10; uncentred ReLU features would always sit below 90).
The same centre (the mean over all C classes) is used for subsets, so two classes still have a real angle.

- global angle: the global model's features, mean over all class pairs (Fig. 3a);
- held angle: each client's personal model, mean over pairs of the classes it holds, then mean over clients
  (Fig. 3b: local adaptation should spread them wider than FedAvg or FedGE do);
- missing angle: the same over pairs of the classes it lacks (Fig. 2: they collapse under FedAvg).

The personal models are rebuilt by one more local update of every client from the final global state (with
the run's seeded generators, as round R + 1 would run it): checkpoints keep only the personal state, not the
locally trained backbone a round's personal evaluation used.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from fedpcd.engine.metrics import Predictor
from fedpcd.errors import UserError


def class_means(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """[C, d]: the mean feature of each class (NaN rows for classes without samples), in one pass over the
    features (a scatter-add by label), on their device."""
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64, device=features.device)
    sums.index_add_(0, labels, features.to(torch.float64))
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    return sums / counts.unsqueeze(1)


def mean_angle(means: Tensor, classes: Tensor | None = None) -> float | None:
    """Mean pairwise angle in degrees between the centred class means of ``classes`` (a bool mask or index
    tensor; default all); classes without samples (NaN rows) are left out; None for fewer than two classes."""
    valid = ~means.isnan().any(1)
    centred = means - means[valid].mean(0, keepdim=True)
    chosen = centred if classes is None else centred[classes]
    chosen = chosen[~chosen.isnan().any(1)]
    if chosen.shape[0] < 2:
        return None
    unit = chosen / chosen.norm(dim=1, keepdim=True)
    cos = (unit @ unit.T).clamp(-1.0, 1.0)
    pairs = torch.triu_indices(len(unit), len(unit), offset=1)
    return float(torch.rad2deg(torch.arccos(cos[pairs[0], pairs[1]])).mean())


BATCH = 512  # test samples per forward pass


@torch.no_grad()
def _means(features: Predictor, model: torch.nn.Module, x: Tensor, y: Tensor, num_classes: int) -> Tensor:
    """The class means of one model's features: one batched pass over the test set."""
    model.eval()
    feats = torch.cat([features(x[i : i + BATCH]) for i in range(0, len(x), BATCH)])
    return class_means(feats, y, num_classes)


def _mean_or_none(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def run_geometry(run_dir: str | Path) -> dict[str, float | None]:
    """The global, held and missing angles (degrees) of a finished run with a checkpoint (see module doc): the
    checkpoint is loaded once, and each model (the global one, each client's personal one) makes one batched
    pass over the test set, whose class means serve all of that model's angles."""
    from fedpcd.algorithms.readout import feature_map
    from fedpcd.engine import load_finished
    from fedpcd.engine.client_update import local_step

    fed, algorithm, ckpt = load_finished(run_dir)
    if fed.context.heterogeneous:
        raise UserError(f"{run_dir}: geometry compares one feature space; this run has several architectures")
    config = fed.config
    server, states = ckpt["server"], ckpt["client_states"]
    model = fed.model_for(0)
    test_x, test_y, classes = fed.test_x, fed.test_y, fed.dataset.num_classes  # normalised, on the device
    global_model = algorithm.global_predictor(model, server)
    angle_all = None
    if global_model is not None:
        angle_all = mean_angle(_means(feature_map(global_model, model), model, test_x, test_y, classes))
    held, missing = [], []
    for k, data in enumerate(fed.clients):
        state = states.get(k)
        payload = algorithm.payload_for(server, k)
        client_model = fed.model_for(k, fresh=state is None)
        _, work = local_step(
            algorithm, client_model, data, payload, state, seed=config.seed, rnd=config.rounds + 1
        )
        personal = feature_map(algorithm.personal_predictor(client_model, work), client_model)
        means = _means(personal, client_model, test_x, test_y, classes)
        present = data.label_counts > 0
        held.append(mean_angle(means, present))
        missing.append(mean_angle(means, ~present))
    return {
        "angle_all": angle_all,
        "angle_held": _mean_or_none(held),
        "angle_missing": _mean_or_none(missing),
    }
