"""engine.device audit: every algorithm creates its tensors on the run's device.

No GPU is needed: a CUDA run's device mix-ups are emulated on the CPU. While a small run of each registered
algorithm goes on, :class:`DeviceAudit` (a ``TorchFunctionMode``, which sees every torch call)

1. flags each tensor factory (``torch.zeros``, ``arange``, ``tensor``, ``randn``, ... see ``FACTORIES``) that
   code in ``src/fedpcd/algorithms/`` calls without ``device=``, unless the device is implied (a tensor
   argument, or a ``generator=`` draw, which is on the generator's device); and
2. tracks the tensors that a CUDA run would keep on the CPU ("host" tensors): factory results without a
   device, from a CPU generator or with ``device="cpu"``, ``torch.from_numpy``, and whatever is computed from
   host tensors only (``nn.Parameter`` of a host tensor included); ``.to(<the run's device>)`` moves one to
   the device. A call that combines a host tensor (other than a 0-dim one, which CUDA accepts as a scalar)
   with a device tensor is flagged with where the host tensor was made. Indexing a device tensor with a host
   index and ``copy_`` are allowed, as on CUDA. The ``.device`` of a host tensor or of a CPU generator is
   ``cpu:0``, the run's is ``cpu``, so ``device=t.device`` and ``.to(t.device)`` follow ``t``.

Everything else -- data, models moved by the engine, client states, what is computed from them -- counts as on
the device. Findings name file:line. ``test_audit_catches`` shows that both checks fire.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import fedpcd
from fedpcd.algorithms import ALGORITHMS
from fedpcd.backends import run_experiment
from fedpcd.resolve import load_config

SRC = os.path.dirname(fedpcd.__file__) + os.sep
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(fedpcd.__file__)))  # file:line relative to this
ALGORITHMS_DIR = os.path.join(SRC, "algorithms") + os.sep
SKIPPED_FILES = (__file__, torch.overrides.__file__)  # frames that are not the caller of a torch function

FACTORIES = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.empty_strided,
        torch.full,
        torch.eye,
        torch.arange,
        torch.linspace,
        torch.logspace,
        torch.tensor,
        torch.as_tensor,
        torch.asarray,
        torch.scalar_tensor,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.normal,
        torch.tril_indices,
        torch.triu_indices,
    }
)
ALLOWED_MIXES = frozenset({Tensor.copy_})  # cross-device copies are fine on CUDA
INDEXING = frozenset({Tensor.__getitem__, Tensor.__setitem__})  # a device tensor may take CPU indices
DEVICE_GETTER = Tensor.device.__get__  # compares equal (==) to what the mode receives for ``t.device``
HOST_DEVICE = torch.device("cpu", 0)  # what ``t.device`` says for a host tensor; the run's device is "cpu"


def _site(frame: FrameType | None) -> str:
    """file:line of the innermost frame in src/fedpcd at or above ``frame``, and of the innermost algorithm
    frame above it if that is another one (a model built or run by an algorithm)."""
    sites = []
    while frame is not None and len(sites) < 2:
        path = frame.f_code.co_filename
        if (path.startswith(SRC) and not sites) or path.startswith(ALGORITHMS_DIR):
            sites.append(f"{os.path.relpath(path, ROOT)}:{frame.f_lineno}")
        if path.startswith(ALGORITHMS_DIR):
            break
        frame = frame.f_back
    if not sites:
        return "<outside fedpcd>"
    return sites[0] if len(sites) == 1 else f"{sites[0]} (from {sites[1]})"


def _caller() -> FrameType | None:
    """The frame that called the torch function being intercepted."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in SKIPPED_FILES:
        frame = frame.f_back
    return frame


def _tensors(obj: Any) -> Iterator[Tensor]:
    """The tensors of a call's arguments or result (lists and tuples one level deep, as torch.cat's)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                yield from (t for t in item if isinstance(t, Tensor))


def _is_host(device: object) -> bool:
    """A device spelt "cpu" (hard-coded), or the ``.device`` of a host tensor; not the run's torch.device."""
    return device == HOST_DEVICE or (isinstance(device, str) and device.startswith("cpu"))


class DeviceAudit(TorchFunctionMode):
    """Records device-less factories in algorithm code and host/device mixes (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.findings: dict[str, None] = {}  # ordered, without repeats
        self._host: dict[int, tuple[weakref.ref, str]] = {}  # id -> (the tensor, where it was made)

    # ----- the host tags -----
    def origin(self, t: Tensor) -> str | None:
        """Where ``t`` was made, if it is a host tensor; None for a device tensor."""
        entry = self._host.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def mark(self, t: Tensor, origin: str) -> None:
        key = id(t)
        self._host[key] = (weakref.ref(t, lambda _ref: self._host.pop(key, None)), origin)

    def unmark(self, t: Tensor) -> None:
        self._host.pop(id(t), None)

    def mark_new(self, out: Any, inputs: list[Tensor], origin: str) -> None:
        """Tag the tensors of ``out`` that are not among ``inputs`` (in-place results keep their tag)."""
        for t in _tensors(out):
            if not any(t is i for i in inputs):
                self.mark(t, origin)

    # ----- the mode -----
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES:
            return self._factory(func, args, kwargs)
        if func is Tensor.to:
            return self._to(args, kwargs)
        inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
        origins = [self.origin(t) for t in inputs]
        hosts = [o for o in origins if o is not None]
        if hosts and func == DEVICE_GETTER:
            return HOST_DEVICE
        out = func(*args, **kwargs)
        if not hosts:
            return out
        on_device = [t for t, o in zip(inputs, origins, strict=True) if o is None]
        if not on_device:  # host tensors only: the result stays on the host
            self.mark_new(out, inputs, hosts[0])
        elif func in INDEXING:  # a CPU tensor cannot take device indices
            if self.origin(args[0]) is not None and any(self.origin(t) is None for t in _tensors(args[1])):
                self.flag(f"a CPU tensor made at {hosts[0]} is indexed by a device tensor")
        elif func not in ALLOWED_MIXES and any(
            t.dim() > 0 for t, o in zip(inputs, origins, strict=True) if o is not None
        ):
            name = getattr(func, "__name__", str(func))
            self.flag(f"{name} mixes a CPU tensor made at {hosts[0]} with the run's device")
        return out

    def _factory(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        device, generator = kwargs.get("device"), kwargs.get("generator")
        inputs = [t for a in args for t in _tensors(a)]
        if inputs and device is None:  # torch.tensor(t), torch.normal(mean, std): where the inputs are
            origins = [self.origin(t) for t in inputs]
            if all(o is not None for o in origins):
                self.mark_new(out, inputs, origins[0])
            return out
        caller = _caller()
        in_algorithm = caller is not None and caller.f_code.co_filename.startswith(ALGORITHMS_DIR)
        if device is None and generator is None and in_algorithm:
            self.flag(f"torch.{func.__name__}(...) without device=", caller)
        cpu_generator = generator is not None and generator.device.type == "cpu"
        if (device is None and (generator is None or cpu_generator)) or _is_host(device):
            self.mark_new(out, [], _site(caller))
        return out

    def _to(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``t.to(...)``: a torch.device (or a device tensor) moves to the device, "cpu" to the host.

        A move that is a no-op here gives a new tensor on CUDA and leaves the host tensor where it was: the
        emulation returns an alias (a view), so that only the moved tensor counts as on the device. A
        parameter (``Module.to``) moves itself."""
        src, out = args[0], Tensor.to(*args, **kwargs)
        target: str | None = None  # "host", "device" or None (a dtype change only)
        for a in (*args[1:], kwargs.get("device"), kwargs.get("other")):
            if isinstance(a, Tensor):
                target = "host" if self.origin(a) is not None else "device"
            elif isinstance(a, (str, torch.device)):
                target = "host" if _is_host(a) else "device"
        origin = self.origin(src)
        if target == "device" and out is src and origin is not None:
            if isinstance(src, nn.Parameter):
                self.unmark(src)
            else:
                out = src.view_as(src)
        elif target != "device" and out is not src and (target == "host" or origin is not None):
            self.mark(out, origin or _site(_caller()))
        return out

    def flag(self, what: str, frame: FrameType | None = None) -> None:
        """Record ``what`` happened at the innermost src/fedpcd frame of ``frame`` (default: the caller)."""
        self.findings[f"{_site(frame or _caller())}: {what}"] = None


class AuditedGenerator(torch.Generator):
    """A torch.Generator whose ``.device`` is ``cpu:0`` for a CPU generator: what it draws is on the host."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        real = super().device
        return HOST_DEVICE if real.type == "cpu" else real


@pytest.fixture
def audit(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeviceAudit]:
    """A DeviceAudit that also sees ``torch.from_numpy``, ``nn.Parameter`` and ``torch.Generator().device``
    (none of them goes through ``__torch_function__``)."""
    mode = DeviceAudit()
    from_numpy = torch.from_numpy
    new_parameter = nn.Parameter.__new__

    def audited_from_numpy(array: Any) -> Tensor:
        out = from_numpy(array)
        mode.mark(out, _site(_caller()))
        return out

    def audited_parameter(cls: type, data: Tensor | None = None, requires_grad: bool = True) -> nn.Parameter:
        param = new_parameter(cls, data, requires_grad)
        origin = mode.origin(data) if data is not None else None
        if origin is not None:
            mode.mark(param, origin)
        return param

    monkeypatch.setattr(torch, "Generator", AuditedGenerator)
    monkeypatch.setattr(torch, "from_numpy", audited_from_numpy)
    monkeypatch.setattr(nn.Parameter, "__new__", staticmethod(audited_parameter))
    with mode:
        yield mode


def test_audit_catches(audit: DeviceAudit) -> None:
    """Both checks fire on code that lives in src/fedpcd/algorithms/, and stay quiet on correct code."""
    model = nn.Linear(3, 2)
    model.to(torch.device("cpu"))  # what the engine does: the model is on the run's device
    source = (
        "x = torch.ones(4, 3, device=w.device)\n"  # line 1: fine
        "bad = torch.zeros(4, 3)\n"  # line 2: device-less
        "g = torch.Generator().manual_seed(0)\n"
        "noise = torch.randn(4, 3, generator=g)\n"  # line 4: a CPU draw, fine until ...
        "y = x + noise.to(w.device)\n"  # line 5: ... moved: fine
        "z = x * noise.double().float()\n"  # line 6: ... used on the device: a mix
        "s = x * torch.tensor(2.0, device='cpu')\n"  # line 7: a 0-dim CPU scalar: fine
        "p = torch.randperm(4, generator=g)\n"
        "q = x[p]\n"  # line 9: a device tensor indexed by a CPU index: fine
    )
    path = os.path.join(ALGORITHMS_DIR, "audit_probe.py")
    exec(compile(source, path, "exec"), {"torch": torch, "w": model.weight})
    rel = os.path.relpath(path, ROOT)
    assert list(audit.findings) == [
        f"{rel}:2: torch.zeros(...) without device=",
        f"{rel}:6: mul mixes a CPU tensor made at {rel}:4 with the run's device",
    ]


# ----- every algorithm, on a tiny federation ----------------------------------------------------------------

SMALL = [
    "dataset.name=synthetic",
    "model.name=mlp",
    "model.hidden=16",
    "clients=3",
    "rounds=2",
    "local.batch_size=32",
    "engine.checkpoint_every=0",
]
SETTINGS = {  # what an algorithm needs on this federation, and cuts of its long server-side loops
    "creff": ["algorithm.retrain_epochs=2", "algorithm.match_steps=2", "algorithm.feats_per_class=4"],
    "fedetf": ["algorithm.finetune_rounds=1", "algorithm.finetune_epochs=1"],
    "fedkd": ["algorithm.shared_model=mlp"],
    "fml": ["algorithm.shared_model=mlp"],
    "fedbn": ["model.name=mlp_bn"],  # FedBN needs BatchNorm layers
}
VARIANTS = {  # further branches that create tensors
    "creff": [
        "algorithm.real_batch=4",
        "algorithm.grad_weighting=samples",
        "algorithm.retrain_init=aggregated",
        "algorithm.grad_head=aggregated",
    ],
    "fd": ["algorithm.distill=kl"],
    "fedclassavg": ["algorithm.prox=norm"],
    "fedgela": ["algorithm.normalize=bn_l2", "algorithm.projection=mlp"],
    "fedmr": ["algorithm.lite_samples=4", "algorithm.submit_fraction=0.5", "algorithm.inter_negatives=all"],
    "fednh": ["algorithm.init=orthogonal", "algorithm.proto_weighting=uniform_paper"],
    "fedproto": ["algorithm.init=none"],
    "fedsc": ["algorithm.compat_official=true"],
    "fedssa": ["algorithm.aggregation=cached_all", "algorithm.upload=zero_filled", "algorithm.case=A"],
    "perfedavg": ["algorithm.variant=hf"],
}
CASES = [
    pytest.param(name, variant, id=name + ("-variant" if variant else ""))
    for name, variant in [(name, []) for name in ALGORITHMS.names()] + list(VARIANTS.items())
]


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_algorithm_is_device_correct(
    tmp_path: Path, audit: DeviceAudit, name: str, variant: list[str]
) -> None:
    overrides = [*SMALL, f"algorithm.name={name}", *SETTINGS.get(name, []), *variant]
    run_experiment(load_config(None, [*overrides, f"output_dir={tmp_path}"]), progress=False)
    assert not audit.findings, "tensors off the run's device:\n" + "\n".join(audit.findings)
