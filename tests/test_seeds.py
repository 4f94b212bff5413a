"""The named random streams (fedpcd.seeds): their values are part of every archived result, and building a
model leaves torch's global generator alone."""

from __future__ import annotations

import torch

from conftest import TINY_SYNTHETIC
from fedpcd import seeds
from fedpcd.engine.federation import build_federation
from fedpcd.models import build_model
from fedpcd.resolve import load_config

# every stream at run seed 7 (round 7, client 7, client seed 7 where it takes them)
PINNED = {
    "client_update": 9059141965454598866,
    "creff_features": 6677017126585864400,
    "creff_real_batches": 8468657461029164644,
    "creff_retrain": 4651184830801468167,
    "dp_noise": 13933447517962452,
    "dp_upload_noise": 7037554213305205732,
    "fedetf_etf": 743799113682294150,
    "fedetf_projection": 2958316275525286064,
    "fedgela_etf": 4884703433366443320,
    "fedgela_projection": 1129743437588471024,
    "fedmr_lite": 1220925115114928559,
    "fedmr_submitters": 4327737000804479860,
    "fednh_prototypes": 770977904577849710,
    "fedproto_prototypes": 8981538698653295313,
    "fml_shared_model": 69410030725838143,
    "initial_model": 6216529600588805488,
    "global_generator": 3107951045063927336,
    "participants": 4858887540138417922,
    "secagg_rounding": 7282049860406125083,
}


def test_every_stream_keeps_its_value():
    streams = {
        name: fn
        for name, fn in vars(seeds).items()
        if callable(fn) and fn.__module__ == seeds.__name__ and name not in ("derive_seed", "generator")
    }
    assert set(streams) == set(PINNED)  # a new stream is pinned here too
    for name, fn in streams.items():
        assert fn(*[7] * fn.__code__.co_argcount) == PINNED[name], name


def test_the_streams_are_the_derived_seeds_of_their_integers():
    assert seeds.initial_model(3) == seeds.derive_seed(3, -1)
    assert seeds.participants(3, 2) == seeds.derive_seed(3, 2, 0x5A)
    assert seeds.client_update(3, 2, 5) == seeds.derive_seed(3, 2, 5)
    g = seeds.generator(seeds.client_update(3, 2, 5))
    assert g.initial_seed() == seeds.derive_seed(3, 2, 5) and g.device.type == "cpu"


def test_building_a_model_leaves_the_global_generator_untouched():
    torch.set_num_threads(1)
    fed = build_federation(load_config(None, [*TINY_SYNTHETIC, "clients=2", "rounds=1"]))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = fed.new_model()
    assert torch.equal(torch.get_rng_state(), before)
    # the weights are those of the initial-model stream, as when the build seeded the global generator
    torch.manual_seed(seeds.initial_model(fed.config.seed))
    ds = fed.dataset
    arch = fed.config.model.architecture(0)
    expected = build_model(arch, ds.in_channels, ds.num_classes, ds.image_size, **fed.config.model.params())
    for (name, a), b in zip(model.state_dict().items(), expected.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_fresh_run_seeds_the_global_generator_once_from_its_stream(tmp_path):
    """Dropout draws from torch's global generator: a fresh run seeds it from its own stream, so two runs of
    one config in one process (the API, a sweep's worker) draw the same masks."""
    from fedpcd.backends import run_experiment

    torch.set_num_threads(1)
    torch.manual_seed(123)
    config = load_config(None, [*TINY_SYNTHETIC, "clients=2", "rounds=1", f"output_dir={tmp_path / 'a'}"])
    run_experiment(config, progress=False)
    assert torch.initial_seed() == seeds.global_generator(config.seed)
