"""fedpcd: federated learning under label skew and partially class-disjoint data.

The Python API (`fedpcd.api`):

```python
import fedpcd

result = fedpcd.run("configs/example.yaml", rounds=2, algorithm__name="fednh")
result.metrics  # one row per evaluated round (a pandas DataFrame)
```

Its names are loaded on first use, so ``import fedpcd`` (and the command line) stays light: no torch, no
pandas until they are needed. Sweeps and reports are `fedpcd.api.sweep` and `fedpcd.api.report`
(`fedpcd.sweep` and `fedpcd.report` are the modules behind the commands).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedpcd._version import __version__ as __version__  # the public front states it

if TYPE_CHECKING:
    from fedpcd.api import Report, RunResult, describe, load_index, load_runs, partition, run
    from fedpcd.config import Config
    from fedpcd.errors import UserError
    from fedpcd.resolve import load_config

_HOMES = {
    "run": "fedpcd.api",
    "Report": "fedpcd.api",
    "RunResult": "fedpcd.api",
    "load_runs": "fedpcd.api",
    "load_index": "fedpcd.api",
    "partition": "fedpcd.api",
    "describe": "fedpcd.api",
    "load_config": "fedpcd.resolve",
    "Config": "fedpcd.config",
    "UserError": "fedpcd.errors",
}
__all__ = [
    "Config",
    "Report",
    "RunResult",
    "UserError",
    "describe",
    "load_config",
    "load_index",
    "load_runs",
    "partition",
    "run",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'fedpcd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
