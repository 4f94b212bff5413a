"""Per-client work: every working value of a client update lives in its ``LocalWork``; an algorithm object
holds only its hyperparameters and what ``setup`` derives from the run context, so a client update (or a
whole round, on either executor) leaves it exactly as it was."""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from fedpcd.algorithms import ALGORITHMS, FedAvg, LocalWork
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation, global_evaluation
from fedpcd.engine.tasks import payloads_for
from fedpcd.resolve import load_config

SMALL = [
    "dataset.name=synthetic",
    "model.name=mlp",
    "model.hidden=16",
    "clients=3",
    "rounds=2",
    "local.batch_size=32",
    "output_dir=unused",
]
SETTINGS = {  # what an algorithm needs on this federation, and cuts of its long loops
    "creff": ["algorithm.retrain_epochs=2", "algorithm.match_steps=2", "algorithm.feats_per_class=4"],
    "fedetf": ["algorithm.finetune_rounds=1", "algorithm.finetune_epochs=1"],
    "fedkd": ["algorithm.shared_model=mlp"],
    "fml": ["algorithm.shared_model=mlp"],
    "fedbabu": ["algorithm.finetune_epochs=1"],
    "fedavg_ft": ["algorithm.finetune_epochs=1"],
    "fedbn": ["model.name=mlp_bn"],  # FedBN needs BatchNorm layers
}
VARIANTS = {  # branches with working values of their own
    "fedsc": ["algorithm.compat_official=true"],
    "fedmr": ["algorithm.lite_samples=4"],
    "fedbabu": ["algorithm.finetune_when=last_round", "algorithm.finetune_from=local"],
    "fedrep": ["algorithm.head_epochs=1"],
    "perfedavg": ["algorithm.variant=hf"],
}
CASES = [
    pytest.param(name, variant, id=name + ("-variant" if variant else ""))
    for name, variant in [(name, []) for name in ALGORITHMS.names()] + list(VARIANTS.items())
]


def _snapshot(obj: Any) -> Any:
    """A deep, comparable copy of ``obj``: tensors (values, dtype, device, requires_grad), modules (mode
    and state), containers, dataclasses and other objects with attributes."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, obj.device, obj.requires_grad, obj.detach().cpu().clone())
    if isinstance(obj, nn.Module):
        grads = [p.requires_grad for p in obj.parameters()]
        return ("module", type(obj), obj.training, grads, _snapshot(obj.state_dict()))
    if isinstance(obj, dict):
        return ("dict", [(k, _snapshot(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_snapshot(v) for v in obj])
    if isinstance(obj, torch.Generator):
        return ("generator", obj.get_state())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj), _snapshot(dict(vars(obj))))
    return obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _changed(before: Any, after: Any) -> list[str]:
    """The algorithm's attributes that differ between two snapshots of ``vars(algorithm)``."""
    old, new = dict(before[1][1]), dict(after[1][1])  # (type, ("dict", [(name, snapshot), ...]))
    return sorted(
        k for k in old.keys() | new.keys() if k not in old or k not in new or not _same(old[k], new[k])
    )


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize(("name", "variant"), CASES)
def test_a_round_leaves_the_algorithm_object_unchanged(name: str, variant: list[str], executor: str) -> None:
    cfg = load_config(
        None,
        [*SMALL, f"algorithm.name={name}", *SETTINGS.get(name, []), *variant, f"engine.executor={executor}"],
    )
    fed = build_federation(cfg)
    algorithm = fed.new_algorithm()
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    states: dict[int, Any] = {}
    for rnd in (1, 2):
        ids = [0, 1, 2] if rnd == 1 else [0, 2]  # first participations, then returning clients
        before = _snapshot(algorithm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the vectorized executor's fall-back notice
            results = LocalExecutor(fed, states=states).train(
                algorithm, payloads_for(algorithm, server, ids), rnd, True
            )
        assert all(r.error is None for r in results), [r.error for r in results]
        assert not _changed(before, _snapshot(algorithm)), f"a client update changed {name}'s attributes"
        server = algorithm.aggregate(server, [r.update for r in results])
        global_evaluation(algorithm, fed.model_for(0), fed, server)  # and its extra global predictors
        assert not _changed(before, _snapshot(algorithm)), f"the server side changed {name}'s attributes"


def test_the_snapshot_sees_a_change() -> None:
    algorithm = ALGORITHMS.get("fml")(shared_model="mlp")
    algorithm.setup(build_federation(load_config(None, SMALL)).context)
    before = _snapshot(algorithm)
    with torch.no_grad():
        next(algorithm.shared.parameters()).add_(1.0)
    assert _changed(before, _snapshot(algorithm)) == ["shared"]


# ----- static checks: no working state on the algorithm, no per-class declarations ------------------------

ALLOWED = {"setup", "__post_init__"}  # where an algorithm may set its own attributes (from ctx and fields)


def _algorithm_classes() -> list[type]:
    """Every registered algorithm and the FedAvg subclasses it builds on (FedAvg included)."""
    seen: dict[type, None] = {}
    for name in ALGORITHMS.names():
        for cls in ALGORITHMS.get(name).__mro__:
            if isinstance(cls, type) and issubclass(cls, FedAvg):
                seen[cls] = None
    return list(seen)


def _self_writes(cls: type) -> list[str]:
    """``self.<attr>`` assignments (also augmented, annotated, deleted, setattr / delattr on self) in the
    methods of ``cls``'s own body other than ``setup`` and ``__post_init__``; and underscore class
    attributes (working state kept on the class)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    found = []
    for stmt in body.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id.startswith("_") and not t.id.startswith("__"):
                    found.append(f"{cls.__name__}.{t.id} (class attribute)")
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or stmt.name in ALLOWED:
            continue
        for node in ast.walk(stmt):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and node.args
                and _is_self(node.args[0])
            ):
                found.append(f"{cls.__name__}.{stmt.name}: {node.func.id}(self, ...)")
            found += [f"{cls.__name__}.{stmt.name}: self.{a}" for t in targets for a in _self_attrs(t)]
    return found


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _self_attrs(target: ast.expr) -> list[str]:
    """The attributes of ``self`` an assignment target writes into (``self.a``, ``self.a[k]``,
    ``self.a.b``, in tuples too); subscripts' indices are read, not written."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for t in target.elts for a in _self_attrs(t)]
    node = target.value if isinstance(target, ast.Starred) else target
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and _is_self(node.value):
            return [node.attr]
        node = node.value
    return []


def test_no_algorithm_writes_working_state_to_itself() -> None:
    classes = _algorithm_classes()
    assert len(classes) >= len(ALGORITHMS.names())
    found = [w for cls in classes for w in _self_writes(cls)]
    assert not found, "working values belong in the LocalWork:\n" + "\n".join(found)


def test_the_scan_sees_writes_to_self() -> None:
    class Bad(FedAvg):
        _flag = False

        def begin_local(self, model, data, work):
            self._scale = 1.0
            self.cache[data.id] = 2
            self.count += 1
            setattr(self, "x", 3)  # noqa: B010
            server = {}
            server[self.name], self.a.b = 1, 2  # reads self.name, writes self.a

    assert sorted(_self_writes(Bad)) == [
        "Bad._flag (class attribute)",
        "Bad.begin_local: self._scale",
        "Bad.begin_local: self.a",
        "Bad.begin_local: self.cache",
        "Bad.begin_local: self.count",
        "Bad.begin_local: setattr(self, ...)",
    ]


def test_vector_attrs_is_gone() -> None:
    assert not hasattr(FedAvg, "vector_attrs")
    assert not [cls.__name__ for cls in _algorithm_classes() if "vector_attrs" in vars(cls)]


# ----- the LocalWork itself -----------------------------------------------------------------------------


def test_local_work_fields_and_working_values() -> None:
    rng = torch.Generator()
    payload = {"model": {}}
    work = LocalWork(payload, None, rng, round=3, scale=torch.ones(()))
    assert work.round == 3 and work.payload is payload and work.received is payload and work.rng is rng
    work.correction = {"w": torch.zeros(2)}
    work.payload = {"model": {}, "extra": 1}  # what the loss sees may change; the received payload not
    assert work.received is payload
    assert list(work.working_values()) == ["scale", "correction"]
    assert work.get("correction") is work.correction and work.get("missing", 5) == 5
    with pytest.raises(AttributeError):
        _ = work.missing
