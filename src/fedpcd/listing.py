"""What ``fedpcd list`` prints without a name: one line per registered component (its name and its
docstring's first sentence, read from the source: no torch) or, for ``fedpcd list configs``, per shipped
config (its leading comment's first sentence), each line at most ``LIST_WIDTH`` characters."""

from __future__ import annotations

import itertools

LIST_WIDTH = 120  # `fedpcd list` lines are at most this long
# a full stop after these ends no sentence
_ABBREVIATIONS = ("e.g.", "i.e.", "al.", "Eq.", "Eqs.", "Sec.", "App.", "Fig.", "Tab.", "cf.", "vs.", "tech.")


def _balanced(text: str) -> bool:
    return text.count("(") == text.count(")") and text.count("``") % 2 == 0


def shorten(doc: str, width: int) -> str:
    """A docstring's first sentence on one line of at most ``width`` characters: whole if it fits, else cut
    after its last clause (', ', '; ', ': ') outside brackets where that keeps three quarters of it, else
    after its last whole word (outside brackets where that keeps half of it, a bracket then closed after the
    ellipsis), and marked with an ellipsis."""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    for i, char in enumerate(text):  # the first sentence: up to a full stop before a capital or the end
        if char == "." and (i + 1 == len(text) or text[i + 1 : i + 3].strip()[:1].isupper()):
            word = text[: i + 1].rsplit(" ", 1)[-1].lstrip("(")
            if not word.endswith(_ABBREVIATIONS) and _balanced(text[: i + 1]):
                text = text[: i + 1]
                break
    if len(text) <= width:
        return text
    room = width - 2  # the ellipsis, and a bracket closed after it
    clauses = [i for i in range(room) if text[i : i + 2] in (", ", "; ", ": ") and _balanced(text[:i])]
    words = [i for i in range(room + 1) if text[i] == " " and _balanced(text[:i])]
    cut = next((i for i in reversed(clauses) if i >= 3 * width // 4), None)  # a whole clause, if long
    cut = cut or next((i for i in reversed(words) if i >= width // 2), None)
    if cut is None:  # inside a long bracket: its last whole word, then the bracket closed
        cut = text[: room + 1].rfind(" ")
    kept = text[: cut if cut > 0 else room].rstrip(" ,;:")
    return kept + "…" + ")" * (kept.count("(") - kept.count(")"))


def list_components() -> None:
    """Each algorithm, dataset, partition scheme and model: its kind, name and first sentence."""
    from fedpcd.catalog import catalog
    from fedpcd.utils import plain_text

    for kind, label in [
        ("algorithm", "algorithm"),
        ("dataset", "dataset"),
        ("partition scheme", "partition"),
        ("model", "model"),
    ]:
        for name, doc in catalog(kind).items():
            head = f"{label:<10} {name:<14} "
            print(head + shorten(plain_text(doc.strip()), LIST_WIDTH - len(head)))


def list_configs() -> None:
    """Each shipped config's name (what ``--config`` takes) and its leading comment's first sentence."""
    from fedpcd.config_input import shipped_configs
    from fedpcd.utils import plain_text

    shipped = shipped_configs()
    width = max(map(len, shipped)) + 2
    for name, path in shipped.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        comment = [line.lstrip("#").strip() for line in itertools.takewhile(_is_comment, lines)]
        print(f"{name:<{width}}" + shorten(plain_text("\n".join(comment)), LIST_WIDTH - width))


def _is_comment(line: str) -> bool:
    return line.startswith("#")
