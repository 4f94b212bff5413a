"""Client states kept compactly: a ``MutableMapping[int, Any]`` from client id to its personal state.

A client state holds only what is personal (a head, control variates, MOON's previous model; None for
FedAvg, which stores nothing), so thousands of clients fit. Two backends (``engine.client_state``):

- ``memory`` (default): a dict in this process. Tensors are stored compactly: a tensor that views a larger
  storage is cloned, so a state never keeps a bigger tensor (a whole reply, a batch) alive.
- ``disk``: one file per client, ``<output_dir>/client_states/<id>.pt``, written atomically (temp file +
  rename) with CPU tensors and read back with ``torch.load(weights_only=True)`` onto the run's device.
  The folder and its files are never symbolic links (refused: writing or deleting there would change what
  they point to), and a failed write or a file that does not load is one line naming the file.
  Only the round's participants are in memory at a time; a store reopened on the same directory (resume)
  sees the files already there.

``to_dict()`` gives the whole store as a plain dict (checkpoints; analysis code reads a dict), ``replace()``
loads one back (resume).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Literal

import torch

from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.config import Config
from fedpcd.engine.checkpoint import load_weights_only
from fedpcd.engine.federation import to_device
from fedpcd.engine.rundir import RunDir, safe_write, save_tensors, writing
from fedpcd.utils import refuse_link

Backend = Literal["memory", "disk"]
SUFFIX = ".pt"


def compact(obj: Any) -> Any:
    """``obj`` with every tensor detached and, where it views a larger storage, copied to its own storage.

    Returns ``obj`` itself when nothing had to change (the usual case: states are cloned already)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            obj = obj.detach()
        own = obj.numel() * obj.element_size()
        return obj.clone() if obj.untyped_storage().nbytes() > own else obj
    if isinstance(obj, Mapping):
        new = {k: compact(v) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    if isinstance(obj, (list, tuple)):
        items = [compact(v) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else type(obj)(items)
    return obj


class ClientStateStore(MutableMapping[int, Any]):
    """Client id -> personal state, in memory or one file per client (see the module docstring)."""

    def __init__(
        self,
        backend: Backend = "memory",
        directory: str | Path | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if backend not in ("memory", "disk"):
            raise ValueError(f"unknown client state backend {backend!r}; valid: memory, disk")
        if backend == "disk" and directory is None:
            raise ValueError("the disk backend needs a directory")
        self.backend: Backend = backend
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._data: dict[int, Any] = {}
        self.directory = Path(directory) if directory is not None else None
        if backend == "disk":
            assert self.directory is not None
            refuse_link(self.directory)
            with writing(self.directory):
                self.directory.mkdir(parents=True, exist_ok=True)
            self._keys = {
                int(p.stem) for p in self.directory.glob(f"*{SUFFIX}") if p.stem.isdigit()
            }  # files of a run being resumed

    def _path(self, key: int) -> Path:
        assert self.directory is not None
        return self.directory / f"{int(key)}{SUFFIX}"

    # ----- MutableMapping -----
    def __getitem__(self, key: int) -> Any:
        if self.backend == "memory":
            return self._data[key]
        if key not in self._keys:
            raise KeyError(key)
        return load_weights_only(self._path(key), self.device, "client state")

    def __setitem__(self, key: int, value: Any) -> None:
        key = int(key)
        state = compact(value)
        if self.backend == "memory":
            self._data[key] = state
            return
        cpu_state = to_device(state, "cpu")
        assert self.directory is not None
        safe_write(self._path(key), lambda fh: save_tensors(cpu_state, fh), "wb", root=self.directory.parent)
        self._keys.add(key)

    def __delitem__(self, key: int) -> None:
        if self.backend == "memory":
            del self._data[key]
            return
        if key not in self._keys:
            raise KeyError(key)
        self._unlink(key)
        self._keys.discard(key)

    def _unlink(self, key: int) -> None:
        with writing(self._path(key)):
            self._path(key).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._data) if self.backend == "memory" else sorted(self._keys))

    def __len__(self) -> int:
        return len(self._data) if self.backend == "memory" else len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in (self._data if self.backend == "memory" else self._keys)

    # ----- whole store -----
    def clear(self) -> None:
        """Remove every state (and, on disk, every state file)."""
        if self.backend == "memory":
            self._data.clear()
            return
        for key in list(self._keys):
            self._unlink(key)
        self._keys.clear()

    def to_dict(self) -> dict[int, Any]:
        """The whole store as a plain dict (for checkpoints): loads every state of the disk backend."""
        return {k: self[k] for k in self}

    def replace(self, states: Mapping[int, Any]) -> None:
        """Make the store hold exactly ``states`` (e.g. a checkpoint's ``client_states`` on resume)."""
        self.clear()
        for k, v in states.items():
            self[k] = to_device(v, self.device) if self.backend == "memory" else v

    def nbytes(self) -> int:
        """Bytes the states take: tensor bytes in memory, file sizes on disk."""
        if self.backend == "memory":
            return sum(tensor_bytes(v) for v in self._data.values())
        return sum(os.path.getsize(self._path(k)) for k in self._keys)

    def __repr__(self) -> str:
        where = f", {self.directory}" if self.backend == "disk" else ""
        return f"ClientStateStore({self.backend}{where}, {len(self)} states)"


def state_store_for(config: Config, device: torch.device | str | None = None) -> ClientStateStore:
    """The store of a run: ``engine.client_state`` (disk: ``<output_dir>/client_states``), on ``device``."""
    backend = config.engine.client_state
    directory = RunDir(config.output_dir).client_states if backend == "disk" else None
    return ClientStateStore(backend, directory, device)
