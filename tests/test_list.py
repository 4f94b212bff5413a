"""``fedpcd list`` and ``fedpcd list NAME`` (fedpcd.api.describe): paper, description, typed parameters."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import pytest
import yaml
from pydantic import Field

import fedpcd
from fedpcd.algorithms import ALGORITHMS
from fedpcd.api import describe
from fedpcd.cli import main
from fedpcd.components import _citation
from fedpcd.data.datasets import DATASETS
from fedpcd.data.partition import PARTITIONERS
from fedpcd.models import MODELS
from fedpcd.params import param_spec, type_text
from fedpcd.resolve import load_config

REGISTRIES = {"algorithm": ALGORITHMS, "model": MODELS, "dataset": DATASETS, "partition scheme": PARTITIONERS}
# the config keys that choose each kind of component, and the section holding its parameters
CHOOSE = {"algorithm": "algorithm.name", "model": "model.name", "partition scheme": "partition.scheme"}
SECTION = {"algorithm": "algorithm", "model": "model", "partition scheme": "partition"}


def _table(block: str) -> dict[str, tuple[str, str]]:
    """parameter -> (type, default) from the table under 'parameters (...):', split on its column rule (a
    description column, where the parameters declare one, is left out)."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("parameters ("))
    rule = lines[start + 2]
    cuts = [0] + [i + 2 for i, (a, b) in enumerate(zip(rule, rule[1:], strict=False)) if a == " " == b]
    rows = {}
    for line in lines[start + 3 :]:
        name, kind, default, *_ = (line[a:b].strip() for a, b in zip(cuts, [*cuts[1:], None], strict=True))
        rows[name] = (kind, default)
    return rows


def test_list_fedgela_shows_its_parameters(capsys):
    """The issue's acceptance: ``fedpcd list fedgela``."""
    assert main(["list", "fedgela"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "algorithm fedgela (fedpcd.algorithms.fedgela.FedGELA)"
    assert lines[1].startswith('paper: Fan et al., NeurIPS 2023, "Federated Learning with Bilateral Curation')
    assert lines[2] == f"description: {ALGORITHMS.get('fedgela').__doc__.splitlines()[0]}"
    rows = _table(out)
    fields = [f.name for f in dataclasses.fields(ALGORITHMS.get("fedgela")) if f.init]
    assert list(rows) == fields
    assert rows["scale"] == ("float > 0", "2.0")
    assert rows["normalize"] == ("one of: l2, bn, bn_l2", "l2")
    assert rows["proj_dim"] == ("int >= 1, or null", "null")


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k, reg in REGISTRIES.items() for n in reg.names()])
def test_every_component_is_described_with_the_defaults_a_config_gets(kind, name):
    """Each table lists the declared parameters, and its defaults read as YAML are what load_config fills
    into the resolved config."""
    block = next(b for b in describe(name).split("\n\n") if b.startswith(f"{kind} {name} ("))
    description = next(line for line in block.splitlines() if line.startswith("description: "))
    assert len(description) > len("description: ") + 10
    if kind == "dataset":
        assert block.endswith(
            "parameters: none of its own (dataset.root, dataset.train_fraction, "
            "dataset.download apply to every dataset)"
        )
        return
    spec = param_spec(kind, name, REGISTRIES[kind].get(name))
    if not spec.defaults:
        assert block.endswith("parameters: none")
        return
    rows = _table(block)
    assert list(rows) == list(spec.defaults)
    resolved = load_config(None, [f"{CHOOSE[kind]}={name}"]).to_dict()[SECTION[kind]]
    assert {key: yaml.safe_load(default) for key, (_, default) in rows.items()} == {
        key: resolved[key] for key in rows
    }


def test_a_name_of_two_kinds_shows_both():
    blocks = describe("fedssa").split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        "algorithm fedssa (fedpcd.algorithms.fedssa.FedSSA)",
        "partition scheme fedssa (fedpcd.data.paper_schemes.fedssa)",
    ]


def test_model_dataset_and_scheme(capsys):
    assert main(["list", "mlp"]) == 0
    assert _table(capsys.readouterr().out) == {"hidden": ("int in [1, 8192]", "200")}
    assert main(["list", "longtail"]) == 0
    out = capsys.readouterr().out
    assert "paper: FedSC, Wang et al., KDD 2025, Sec. 5.1 and Table 2" in out
    rows = _table(out)
    assert rows["rho"] == ("float >= 1", "10.0")
    assert rows["then"][0] == "mapping" and rows["then"][1].startswith("{scheme: dirichlet, beta: 0.2, ")
    assert main(["list", "fmnist"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "dataset fmnist (fedpcd.data.datasets.load_fmnist)\npaper: Xiao et al., arXiv:1708.07747, 2017\n"
    )


def test_unknown_name_is_one_line_with_the_near_names_by_kind(capsys):
    assert main(["list", "fedfoo"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith(
        "fedpcd: error: unknown name 'fedfoo'; did you mean algorithms: fedproto, fedrod, fedetf? ("
    )
    with pytest.raises(fedpcd.UserError):
        fedpcd.describe("fedfoo")


def test_plain_list_names_every_component_once_per_kind(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kinds = {
        "algorithm": "algorithm",
        "dataset": "dataset",
        "partition": "partition scheme",
        "model": "model",
    }
    listed = [(kinds[line.split()[0]], line.split()[1]) for line in lines]
    assert sorted(listed) == sorted((k, n) for k, reg in REGISTRIES.items() for n in reg.names())


@pytest.mark.parametrize(
    ("annotation", "text"),
    [
        (Annotated[float, Field(ge=0.0)], "float >= 0"),
        (Annotated[float, Field(gt=0.0, le=1.0)], "float in (0, 1]"),
        (Literal["a", "b"], "one of: a, b"),
        (Literal["a", "b"] | None, "one of: a, b, null"),
        (Annotated[int, Field(ge=1)] | None, "int >= 1, or null"),
        (Annotated[float | None, Field(gt=0.0)], "float > 0, or null"),
        (dict[str, Any], "mapping"),
        (bool, "bool"),
        (str, "str"),
        (Any, "any"),
    ],
)
def test_type_text(annotation, text):
    assert type_text(annotation) == text


def test_citation_is_the_first_parenthesised_part_naming_a_year():
    assert (
        _citation("CNN-1 (Table 4) of FedSSA (Yi et al. (IJCAI), 2024), Sec. 6") == "Yi et al. (IJCAI), 2024"
    )
    assert _citation("pathological (FedMR App. C.1.2)") is None


def test_descriptions_cite_nothing_outside_the_repository():
    from test_no_external_refs import forbidden_hits

    names = sorted({n for reg in REGISTRIES.values() for n in reg.names()})
    assert not [hit for name in names for hit in forbidden_hits(describe(name))]


def test_shorten_keeps_a_fitting_first_sentence_and_cuts_a_long_one_at_a_word_with_an_ellipsis():
    from fedpcd.listing import shorten

    doc = "FedX: a method\n    spanning two lines (Doe et al., 2024). Then more.\n\nDetails."
    assert shorten(doc, 80) == "FedX: a method spanning two lines (Doe et al., 2024)."
    assert shorten("One. Two.", 80) == "One."  # the first sentence only
    assert shorten("Eq. 3 holds, i.e. Fine here.", 80) == "Eq. 3 holds, i.e. Fine here."  # abbreviations
    assert shorten("alpha beta gamma delta epsilon", 20) == "alpha beta gamma…"  # a whole word, never a part
    # a clause is kept whole where it keeps three quarters of the width; else the last whole word
    assert shorten("aaaa bbbb cccc dddd eeee, ffff gggg", 30) == "aaaa bbbb cccc dddd eeee…"
    assert shorten("aaaa, bbbb cccc dddd eeee ffff gggg", 30) == "aaaa, bbbb cccc dddd eeee…"
    # inside a long bracket: the last whole word, the bracket closed after the ellipsis
    assert shorten("Name (aaaa bbbb cccc dddd eeee ffff)", 25) == "Name (aaaa bbbb cccc…)"


def test_plain_list_lines_fit_and_mark_every_shortened_description(capsys):
    from fedpcd.listing import LIST_WIDTH
    from fedpcd.utils import plain_text

    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shortened = 0
    for line in lines:
        kind, name = line.split()[:2]
        registry = next(reg for k, reg in REGISTRIES.items() if k.startswith(kind))
        doc = plain_text(" ".join(registry.get(name).__doc__.split("\n\n")[0].split()))  # `x`, not ``x``
        text = line[len(f"{kind:<10} {name:<14} ") :]
        assert len(line) <= LIST_WIDTH
        if "…" in text:
            shortened += 1
            kept = text[: text.index("…")]
            assert text.endswith("…") or text.endswith("…)")
            assert doc.startswith(kept) and doc[len(kept)] in " ,;:"  # cut between words, never inside one
        else:
            assert doc.startswith(text) and text.endswith((".", ")"))  # a whole sentence
    assert shortened > 0
