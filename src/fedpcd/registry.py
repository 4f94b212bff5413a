"""Name -> object registries for datasets, partitioners, models and algorithms.

Each registry also holds the plugins of its entry-point group (`PLUGIN_GROUPS`, docs/plugins.md): an
entry point names a module (or an object in one) whose import registers classes. A registry imports its
plugins once, the first time it is queried, after its built-ins; so every process that looks a name up
(the CLI, sweep workers, Flower nodes) sees the same plugins.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from fedpcd.errors import UserError, choices, clip

T = TypeVar("T")

# registry kind -> (entry-point group, the module whose import registers the built-ins)
PLUGIN_GROUPS = {
    "algorithm": ("fedpcd.algorithms", "fedpcd.algorithms"),
    "model": ("fedpcd.models", "fedpcd.models"),
    "dataset": ("fedpcd.datasets", "fedpcd.data.datasets"),
    "partition scheme": ("fedpcd.partitions", "fedpcd.data.partition"),
}

_LOCK = threading.RLock()  # one thread imports the plugins; re-entered by a plugin that queries a registry


def _plugin_label(ep: EntryPoint) -> str:
    dist = f" from {ep.dist.name}" if getattr(ep, "dist", None) is not None else ""
    return f"{ep.name!r} ({ep.group} = {ep.value}{dist})"


def _load_error(ep: EntryPoint, err: BaseException) -> UserError:
    """One line naming the plugin and what its import raised (a message of several lines is joined; a
    ``sys.exit()`` shows as SystemExit and its code)."""
    text = clip(" ".join(str(err).split()), 200)
    return UserError(f"plugin {_plugin_label(ep)} failed to load: {type(err).__name__}: {text}")


class PluginExit(BaseException):
    """A plugin called ``os._exit(code)`` while it was imported (raised instead of ending the process)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"it called os._exit({code}) while imported")


@contextlib.contextmanager
def _exit_raises() -> Iterator[None]:
    """``os._exit`` raises :class:`PluginExit` for the block (a plugin's import): a plugin that ends the
    process at import, which no atexit hook or ``finally`` can see, is a failed plugin of one line instead
    of a command that exits 0 with no output."""

    def refuse(code: int) -> None:
        raise PluginExit(code)

    real = os._exit
    os._exit = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


class Registry(Generic[T]):
    """A small named registry whose lookups fail with the list of valid names.

    Args:
        kind: What it registers, as its messages name it: "algorithm", "model", "dataset" and "partition
            scheme" (the kinds of `PLUGIN_GROUPS`, whose lookups load the plugins first), or another.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._plugins_loaded = kind not in PLUGIN_GROUPS
        self._plugin_error: UserError | None = None

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers the class or function it decorates as `name` and returns it unchanged.

        Args:
            name: The name that configs and `fedpcd list` use.

        Returns:
            The decorator; applied to a second object of the same name, it raises `ValueError`.
        """

        def decorator(obj: T) -> T:
            if name in self._items:
                taken = getattr(self._items[name], "__module__", "another module")
                raise ValueError(f"{self.kind} {name!r} is already registered by {taken}")
            self._items[name] = obj
            return obj

        return decorator

    def _load_plugins(self) -> None:
        """Import the built-ins, then every entry point of this kind's group (once per process)."""
        with _LOCK:
            if not self._plugins_loaded:
                self._plugins_loaded = True  # set first: a plugin's own queries must not load it again
                group, builtins = PLUGIN_GROUPS[self.kind]
                importlib.import_module(builtins)
                for ep in entry_points(group=group):
                    try:
                        with _exit_raises():
                            ep.load()
                    except KeyboardInterrupt:
                        raise
                    except BaseException as err:  # sys.exit() or any BaseException: a failed plugin too
                        self._plugin_error = _load_error(ep, err)
                        break
        if self._plugin_error is not None:
            raise self._plugin_error

    def unregister(self, name: str) -> T:
        """Remove a registration (e.g. a test's temporary one).

        Args:
            name: A registered name.

        Returns:
            The object that was registered as `name`.

        Raises:
            UserError: `name` is not registered (the message lists the registered names).
        """
        if name not in self._items:
            raise choices(self.kind, name, list(self._items))
        return self._items.pop(name)

    def get(self, name: str) -> T:
        """The object registered as `name`, the plugins loaded first.

        Args:
            name: A registered name.

        Returns:
            The registered class or function.

        Raises:
            UserError: `name` is not registered (the message lists the registered names), or a plugin failed
                to load (the message names it and its error).
        """
        self._load_plugins()
        if name not in self._items:
            raise choices(self.kind, name, list(self._items))
        return self._items[name]

    def names(self) -> list[str]:
        """Every registered name, plugins included, sorted.

        Raises:
            UserError: A plugin failed to load (the message names it and its error).
        """
        self._load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
