"""The value schema of the files a reader of runs loads: a round's record of ``metrics.jsonl``,
``summary.json`` and a row of a sweep's ``index.sqlite``. A reader validates what it loads here before using
a value, so a hand-edited or foreign file (``rounds: 1e30``, ``wall_s: Infinity``, ``global_acc: "abc"``, a
``NaN`` in a record) is one line naming the file and the field, never a row of a table.

Bounds: accuracies are fractions in [0, 1]; round counts whole numbers in [0, ``MAX_ROUNDS``]; wall times and
byte counts finite and non-negative. Keys a schema does not name are kept as they are (records carry
algorithm-specific extras). No torch here: the report and the sweep start without loading it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from fedpcd.errors import UserError, short
from fedpcd.run_format import ACCURACY_KEYS, REPORTED

MAX_ROUNDS = 10**9  # the most rounds a run file may count

Rounds = Annotated[int, Field(strict=True, ge=0, le=MAX_ROUNDS)]
Accuracy = Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)]
Amount = Annotated[float, Field(strict=True, ge=0.0, allow_inf_nan=False)]
_KEEP_EXTRAS = ConfigDict(extra="allow")
_RANGE_ERRORS = {"greater_than_equal": "ge", "less_than_equal": "le"}

_NUMBERS: dict[str, Any] = {
    **{key: (Accuracy | None, None) for key in dict.fromkeys([*ACCURACY_KEYS, *(m.key for m in REPORTED)])},
    "bytes_up": (Amount | None, None),
    "bytes_down": (Amount | None, None),
    "wall_s": (Amount | None, None),
    "global_class_acc": (list[Accuracy | None] | None, None),
}
# a record of metrics.jsonl; a summary's "final" is the last record without its per-client lists
Record = create_model("Record", __config__=_KEEP_EXTRAS, round=(Rounds, ...), **_NUMBERS)
FinalRecord = create_model("FinalRecord", __config__=_KEEP_EXTRAS, round=(Rounds | None, None), **_NUMBERS)


class Summary(BaseModel):
    """summary.json: the configured rounds, the wall time, the last record and each accuracy's best."""

    model_config = _KEEP_EXTRAS
    rounds: Rounds
    wall_s: Amount
    final: FinalRecord | None = None  # type: ignore[valid-type]
    best: dict[str, Accuracy | None] = {}
    best_round: dict[str, Rounds] = {}


class IndexRow(BaseModel):
    """A row of a sweep's index.sqlite (``fedpcd.sweep.index.INDEX_COLUMNS``): its numbers and status."""

    model_config = _KEEP_EXTRAS
    output_dir: str
    status: str
    rounds: Rounds | None = None
    seed: Annotated[int, Field(strict=True)] | None = None
    clients: Rounds | None = None
    final_ga: Accuracy | None = None
    final_pa: Accuracy | None = None
    best_ga: Accuracy | None = None
    best_pa: Accuracy | None = None
    wall_s: Amount | None = None


def check(schema: type[BaseModel], data: Any, where: str) -> dict[str, Any]:
    """``data`` as ``schema`` admits it (a dict, unchanged), else a UserError of one line: ``where``, then
    what is wrong with the first bad field (``it has no 'rounds'``, ``'wall_s' must be a number, got inf``).

    Args:
        schema: :data:`Record`, :class:`Summary` or :class:`IndexRow`.
        data: The parsed JSON object (or row).
        where: The file (and line) for the message, e.g. ``summary file runs/a/summary.json is not a fedpcd
            summary``.
    """
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        schema.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"{where}: {_problem(exc.errors()[0])}") from None
    return data


_KINDS = {
    "int": "a whole number",
    "float": "a number",
    "finite": "a finite number",
    "list": "a list",
    "string": "text",
    "dict": "a JSON object",
    "model": "a JSON object",
}


def _problem(error: Any) -> str:
    """One pydantic error as words: the field (dotted, list positions in brackets) and what it must be."""
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
    kind = error["type"]
    if kind == "missing":
        return f"it has no '{field}'"
    if kind in _RANGE_ERRORS:
        limit = _RANGE_ERRORS[kind]
        need = f"{'>=' if limit == 'ge' else '<='} {error['ctx'][limit]}"
    else:
        need = _KINDS.get(kind.split("_")[0], "valid")
    return f"'{field}' must be {need}, got {short(error['input'])}"
