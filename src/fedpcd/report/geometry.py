"""Class-mean geometry of a finished run that did not record it: the angles FedGELA's paper plots (Fig. 2,
3a-b, 5), as ``geometry: true`` records them in a run's last round (``fedpcd.engine.metrics``: the
definitions), rebuilt from the run's checkpoint.

The personal models are rebuilt by one more local update of every client from the final global state (with
the run's seeded generators, as round R + 1 would run it): checkpoints keep only the personal state, not the
locally trained backbone a round's personal evaluation used. That costs a round of training over every
client, where ``geometry: true`` costs one pass of features per participant in the run's last round.
"""

from __future__ import annotations

from pathlib import Path

from fedpcd.engine.metrics import feature_means, held_missing_angles, mean_angle, mean_of_angles
from fedpcd.errors import UserError
from fedpcd.run_format import ANGLES

BATCH = 512  # test samples per forward pass


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
        model.eval()
        angle_all = mean_angle(
            feature_means(feature_map(global_model, model), test_x, test_y, classes, BATCH)
        )
    held, missing = [], []
    for k, data in enumerate(fed.clients):
        state = states.get(k)
        payload = algorithm.payload_for(server, k)
        client_model = fed.model_for(k, fresh=state is None)
        _, work = local_step(
            algorithm, client_model, data, payload, state, seed=config.seed, rnd=config.rounds + 1
        )
        personal = feature_map(algorithm.personal_predictor(client_model, work), client_model)
        client_model.eval()
        angles = held_missing_angles(
            feature_means(personal, test_x, test_y, classes, BATCH), data.label_counts
        )
        held.append(angles[0])
        missing.append(angles[1])
    return dict(zip(ANGLES, (angle_all, mean_of_angles(held), mean_of_angles(missing)), strict=True))
