"""The local optimiser (fedpcd.algorithms.sgd): torch.optim.SGD's step bit for bit, in the shared loop too,
without importing torch._dynamo in a training process."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import seeded, tiny_client
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.contract import train_loop
from fedpcd.algorithms.sgd import sgd_update
from fedpcd.models import build_model


def _net() -> nn.Module:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(1, 3, 2), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
    net[3].bias.requires_grad_(False)  # a weight without a gradient: no step for it
    return net


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize(("momentum", "decay"), [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-3), (0.9, 1e-3)])
def test_sgd_update_is_torch_sgd_bit_for_bit(momentum: float, decay: float, clip: float | None) -> None:
    ours, theirs = _net(), _net()
    opt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum, weight_decay=decay)
    params = [p for p in ours.parameters()]
    buffers: list[torch.Tensor | None] = [None] * len(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(6, 1, 5, 5, generator=g), torch.randint(0, 4, (6,), generator=g)
        for net in (ours, theirs):
            for p in net.parameters():
                p.grad = None
            F.cross_entropy(net(x), y).backward()
            if clip is not None:
                nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], clip)
        opt.step()
        sgd_update(params, [p.grad for p in params], buffers, 0.05, momentum, decay)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(ours[0].weight, _net()[0].weight)  # it did train
    assert torch.equal(ours[3].bias, _net()[3].bias)  # the weight without a gradient did not move
    if momentum:
        mine = [b for b in buffers if b is not None]
        torch_buffers = [opt.state[p]["momentum_buffer"] for p in theirs.parameters() if p in opt.state]
        assert len(mine) == len(torch_buffers) == 3
        assert all(torch.equal(a, b) for a, b in zip(mine, torch_buffers, strict=True))


def test_the_shared_loop_steps_as_torch_sgd_after_the_clip() -> None:
    """FedAvg's local epochs (momentum, weight decay, gradient clip) equal a loop over the same batches with
    torch.optim.SGD and clip_grad_norm_, bit for bit."""
    local = LocalTraining(epochs=2, batch_size=3, lr=0.1, momentum=0.9, weight_decay=1e-3, grad_clip=0.5)
    alg = build_algorithm("fedavg", {})
    alg.setup(Context(num_clients=1, num_classes=3, rounds=1, seed=0, local=local))
    torch.manual_seed(0)
    model = build_model("mlp", 1, 3, 2, hidden=8)
    reference = copy.deepcopy(model)
    y = torch.tensor([0, 1, 1, 2, 2, 2, 0, 1])
    data = tiny_client(y, 3, seed=7)
    work = LocalWork({}, None, seeded())
    train_loop(alg, model, data, work)

    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    reference.train()
    rng = seeded()
    steps = 0
    for _ in range(2):
        for x, t in data.batches(3, rng):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(reference(x), t).backward()
            nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
            opt.step()
            steps += 1
    assert work.steps == steps == 6
    for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_training_process_does_not_import_torch_dynamo(tmp_path) -> None:
    """torch.optim imports torch._dynamo when an optimiser is built (about 1 s); no client loop does: the
    shared loop (FedAvg) and the methods with their own loops (APFL, pFedMe, CReFF, FedETF), one process."""
    runs = {
        "fedavg": [],
        "apfl": [],
        "pfedme": [],
        "creff": ["algorithm.retrain_epochs=1", "algorithm.match_steps=1", "algorithm.feats_per_class=2"],
        "fedetf": ["algorithm.finetune_rounds=1", "algorithm.finetune_epochs=1"],
    }
    small = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=2", "rounds=1", "--quiet"]
    code = "import sys\nfrom fedpcd.cli import main\n" + "".join(
        f"main(['run', 'algorithm.name={name}', *{small + extra!r}, 'output_dir={tmp_path / name}'])\n"
        for name, extra in runs.items()
    )
    code += "print('torch' in sys.modules, 'torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["True", "False"]
    for name in runs:
        assert (tmp_path / name / "metrics.jsonl").read_text().count("\n") == 1, name
