"""benchmarks/render_docs.py: every results page is its template rendered against the archive, byte for
byte; a single edit to any rendered page fails the check; the directives compute what they claim and refuse
what the runs do not back."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
render_docs = importlib.util.module_from_spec(SPEC)
sys.modules["render_docs"] = render_docs  # dataclasses look their module up
SPEC.loader.exec_module(render_docs)


@pytest.fixture(scope="module")
def env():
    """One environment for the module's renderings: its archive reads each folder once."""
    return render_docs.environment(ROOT)


@pytest.fixture(scope="module")
def rendered(env) -> dict[str, str]:
    return {page: render_docs.render(ROOT, page, env) for page in render_docs.PAGES}


def test_every_page_equals_its_rendering(rendered):
    for page, text in rendered.items():
        assert (ROOT / page).read_text() == text, f"{page}: run python benchmarks/render_docs.py {page}"


FLIPS = {
    "yes": "no",
    "no": "yes",
    "above": "below",
    "below": "above",
    "separates": "within seed noise",
    "within seed noise": "separates",
    "direction only": "yes",
    "↑": "↓",
    "↓": "↑",
}
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+\.\d+")


def _edits(text: str, rng: random.Random, count: int) -> list[str]:
    """``count`` copies of ``text`` with one random single edit each: a digit of a number changed, a ±
    value's digit changed, or a verdict or direction word turned round."""
    numbers = list(NUMBER.finditer(text))
    words = [m for w in FLIPS for m in re.finditer(rf"(?<![\w-]){re.escape(w)}(?![\w-])", text)]
    out = []
    for _ in range(count):
        if words and (not numbers or rng.random() < 0.3):
            m = rng.choice(words)
            out.append(text[: m.start()] + FLIPS[m.group()] + text[m.end() :])
            continue
        m = rng.choice(numbers)
        digits = [i for i, ch in enumerate(m.group()) if ch.isdigit()]
        at = m.start() + rng.choice(digits)
        out.append(text[:at] + str((int(text[at]) + rng.randint(1, 9)) % 10) + text[at + 1 :])
    return out


# README's results, the five method pages and the presets page (with at least this many comparisons each):
# each comparison's two sides from one clean commit (the baselines pages still hold runs archived before runs
# recorded their code version, marked there)
CLEAN_PAGES = {
    "README.md": 15,
    "docs/results/fedgela.md": 30,
    "docs/results/fedmr.md": 50,
    "docs/results/fednh.md": 9,
    "docs/results/fedsc.md": 15,
    "docs/results/fedssa.md": 15,
    "docs/results/presets.md": 70,
}


@pytest.mark.parametrize("page", CLEAN_PAGES)
def test_every_comparison_on_readme_and_the_method_pages_is_of_one_clean_commit(page, env, monkeypatch):
    made, claim = [], env.globals["claim"]

    def recording(*args, **kwargs):
        made.append(claim(*args, **kwargs))
        return made[-1]

    monkeypatch.setitem(env.globals, "claim", recording)
    render_docs.render(ROOT, page, env)
    unclean = {c.label: c.code[1] for c in made if c.ref is not None and c.code is not None}
    assert len([c for c in made if c.ref is not None]) >= CLEAN_PAGES[page]
    assert unclean == {}


def test_random_single_edits_of_every_page_fail_the_check(rendered):
    rng = random.Random(0)
    tried = 0
    for page, text in rendered.items():
        for edited in _edits(text, rng, 4):
            assert edited != text
            assert render_docs.differences(page, edited, text), f"{page}: an edit passed the check"
            tried += 1
    assert tried >= 30


def test_the_check_names_the_first_differing_line():
    found = "a\nb 1.25\nc\n"
    assert render_docs.differences("p.md", found, "a\nb 1.26\nc\n") == [
        "p.md line 2: found '1.25', the rendering has '1.26'"
    ]
    assert render_docs.differences("p.md", found, found) == []


# ---- the directives on a tiny archive ---------------------------------------------------------------------


def _run(
    root: Path,
    name: str,
    algorithm: str,
    seed: int,
    acc: list[float],
    commit: str | None = "abc",
    **keys: object,
) -> None:
    folder = root / "docs/results/runs" / name
    folder.mkdir(parents=True)
    config = {"seed": seed, "clients": 4, "rounds": len(acc), "algorithm": {"name": algorithm}, **keys}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    records = [{"round": r + 1, "global_acc": a} for r, a in enumerate(acc)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    code = {"fedpcd": "0.1.0", "commit": commit, "results": 1} if commit else None
    best = {"global_acc": max(acc)}
    summary = {
        "rounds": len(acc),
        "wall_s": 1.0,
        "final": records[-1],
        "best": best,
        "best_round": {"global_acc": 1},
    }
    (folder / "summary.json").write_text(json.dumps({**summary, **({"code": code} if code else {})}))


def _stopped(
    root: Path, name: str, seed: int, rnd: int, error: str = "DivergenceError", commit: str | None = "abc"
):
    """A run folder as the engine leaves a run that round ``rnd`` stopped: config.yaml and stopped.json."""
    folder = root / "docs/results/runs" / name
    folder.mkdir(parents=True)
    config = {"seed": seed, "clients": 4, "rounds": 10, "algorithm": {"name": "fedlc"}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    code = {"code": {"fedpcd": "0.1.0", "commit": commit, "results": 1}} if commit else {}
    (folder / "stopped.json").write_text(json.dumps({"round": rnd, "error": error, "message": "m", **code}))


def test_diverged_counts_the_runs_stopped_by_divergence_against_every_seed_of_the_pattern(tmp_path):
    for seed in (0, 1, 2):
        _stopped(tmp_path, f"x/fedlc_seed{seed}", seed, 1)
    _run(tmp_path, "x/fedlc_seed3", "fedlc", 3, [0.1, 0.2])  # finished: a seed that did not diverge
    _stopped(tmp_path, "x/fedlc_seed4", 4, 2, error="AggregationError")  # stopped, but not by divergence
    _stopped(tmp_path, "y/fedlc_seed0", 0, 1)  # another folder
    _papers(tmp_path, SINGLE)
    (tmp_path / "templates/t.md.j2").write_text("FedLC {% set d = diverged('x/fedlc_seed*') %}{{ d }}.\n")
    assert render_docs.render(tmp_path, "t.md") == "FedLC diverged in round 1 on 3 of 4 seeds.\n"
    d = render_docs.Archive(tmp_path).diverged("x/fedlc_seed*")
    assert (d.n, d.seeds, d.rounds, d.code) == (3, [0, 1, 2, 3], {0: 1, 1: 1, 2: 1}, None)
    _stopped(tmp_path, "x/fedlc_seed5", 5, 4, commit=None)  # stopped before stopped.json had the code
    d = render_docs.Archive(tmp_path).diverged("x/fedlc_seed*")
    assert str(d) == "diverged in rounds 1-4 on 4 of 5 seeds" and d.code[0] == "no commit recorded"
    with pytest.raises(render_docs.RenderError, match="no archived run matching it stopped by divergence"):
        render_docs.Archive(tmp_path).diverged("x/fedlc_seed3")


def _paper(margin: float) -> render_docs.PaperResult:
    return render_docs.PaperResult("k", "S", "Table 1", "M", 50.0 + margin, "FedAvg", 50.0)


def test_a_paper_result_renders_its_entry_and_margin():
    papers = render_docs.load_papers(ROOT)
    gela = render_docs.paper_result(papers, "fedgela-p10c2-ga")
    assert str(gela) == "CIFAR-10 P10C2 (Table 5): FedGELA 59.60 vs FedAvg 47.26 GA, +12.3"
    assert gela.margin == 12.3  # 59.60 - 47.26 = 12.34, quoted to one decimal
    level = render_docs.PaperResult("k", "S", "Table 2", "A", 96.54, "B", 96.53)
    assert level.margin == 0 and str(level).endswith("B 96.53, level")
    with pytest.raises(render_docs.RenderError, match="not in templates/papers.yaml"):
        render_docs.paper_result(papers, "nope")


def _papers(root: Path, text: str) -> None:
    (root / "templates").mkdir(parents=True, exist_ok=True)
    (root / render_docs.PAPERS).write_text(text)


SINGLE = "x: {setting: S, table: Table 1, method: MOON, value: 83.0, metric: GA}\n"


def test_a_single_value_renders_at_its_quoted_precision(tmp_path):
    _papers(tmp_path, SINGLE + "y: {setting: S, table: T, method: A, value: 67.1, value_decimals: 1}\n")
    (tmp_path / "templates/t.md.j2").write_text("{{ paper('x').value_text }} {{ paper('y').value_text }}\n")
    assert render_docs.render(tmp_path, "t.md") == "83.00 67.1\n"
    single = render_docs.load_papers(tmp_path)["x"]
    assert str(single) == "S (Table 1): MOON 83.00 GA"
    with pytest.raises(render_docs.RenderError, match="no baseline"):
        _ = single.baseline_text
    gela = render_docs.load_papers(ROOT)["fedgela-p10c2-ga"]
    assert (gela.value_text, gela.baseline_text) == ("59.60", "47.26")
    _papers(tmp_path, "z: {setting: S, table: T, method: M, value: 1.0, baseline: FedAvg}\n")
    with pytest.raises(render_docs.RenderError, match="both baseline and baseline_value"):
        render_docs.load_papers(tmp_path)


def test_a_hand_typed_number_in_a_paper_column_is_reported(tmp_path):
    template = tmp_path / "t.md.j2"
    template.write_text(
        "| method | paper (ResNet-18, 100 x 10) | GA |\n|---|---|---|\n"
        "| FedAvg | 67.29 | {{ t.cell('fedavg', 'GA') }} |\n"
        "| MOON | {{ paper('x').value_text }} | {{ t.cell('moon', 'GA') }} |\n"
    )
    assert render_docs.scan_template(template.read_text()) == [
        "line 3: a number outside a directive: '67.29' in '67.29'"
    ]


@pytest.fixture
def archive(tmp_path):
    for seed, (a, b) in enumerate([(0.70, 0.60), (0.72, 0.61), (0.69, 0.60), (0.71, 0.62), (0.73, 0.61)]):
        _run(tmp_path, f"x/fedprox_seed{seed}", "fedprox", seed, [0.1, a])
        _run(tmp_path, f"x/fedavg_seed{seed}", "fedavg", seed, [0.1, b])
    return render_docs.Archive(tmp_path)


def test_a_paired_claim_computes_the_differences_in_points(archive):
    c = archive.claim("x/fedprox_seed*", ref="x/fedavg_seed*", metric="global_acc", last=1)
    assert [round(d, 6) for d in c.each] == [10.0, 11.0, 9.0, 9.0, 12.0]
    assert str(c) == "+10.20 ± 1.30 (5 seeds: +10.00, +11.00, +9.00, +9.00, +12.00)"
    assert c.run.mean == pytest.approx(71.0) and c.ref.mean == pytest.approx(60.8)
    assert c.verdict(_paper(16.0)) == "yes" and c.verdict(_paper(30.0)) == "direction only"
    with pytest.raises(render_docs.RenderError, match="comes from paper"):
        c.verdict(16.0)  # a margin typed into a template, not the paper's data
    _papers(archive.repo, SINGLE)
    with pytest.raises(render_docs.RenderError, match="single value") as refused:
        c.verdict(render_docs.load_papers(archive.repo)["x"])  # no baseline, so no margin
    assert "\n" not in str(refused.value)
    assert c.says("separates", "separates") == "separates"
    assert c.separation == "separates"
    with pytest.raises(render_docs.RenderError, match="do not support"):
        c.says("within seed noise", "noise")
    with pytest.raises(render_docs.RenderError, match="do not support"):
        c.says("below", "below")
    assert c.says("on every seed", "every seed") == "on every seed"
    assert c.says("every seed", "above on every seed") == "every seed"
    with pytest.raises(render_docs.RenderError, match="do not support"):
        c.says("every seed", "below on every seed")  # "lower on every seed" of differences all above 0
    with pytest.raises(render_docs.RenderError, match="do not support"):
        c.says("the seeds disagree", "mixed signs")  # +9 to +12: one sign


def test_seeds_of_both_signs_are_what_mixed_signs_says(tmp_path):
    for seed, value in enumerate((0.62, 0.58, 0.61)):
        _run(tmp_path, f"w/fedprox_seed{seed}", "fedprox", seed, [value])
        _run(tmp_path, f"w/fedavg_seed{seed}", "fedavg", seed, [0.60])
    c = render_docs.Archive(tmp_path).claim("w/fedprox_seed*", ref="w/fedavg_seed*", last=1)
    assert c.says("the seeds disagree", "mixed signs") == "the seeds disagree"
    for sense in ("every seed", "above on every seed", "below on every seed"):
        with pytest.raises(render_docs.RenderError, match="do not support"):
            c.says("on every seed", sense)


def test_runs_of_another_commit_get_no_verdict_and_marked_words(tmp_path):
    for seed in range(5):
        _run(tmp_path, f"y/fedprox_seed{seed}", "fedprox", seed, [0.7 + seed / 100])
        _run(tmp_path, f"y/fedavg_seed{seed}", "fedavg", seed, [0.6], commit="def" if seed else None)
    archive = render_docs.Archive(tmp_path)
    c = archive.claim("y/fedprox_seed*", ref="y/fedavg_seed*", last=1)
    assert c.verdict(_paper(10.0)) == "no verdict (no commit recorded)"
    assert c.says("separates", "separates") == "separates" + render_docs.LEGACY_MARK
    assert archive.legacy  # the page must then place legacy_note()


def test_a_separation_on_fewer_than_five_seeds_is_not_called_one(tmp_path):
    for seed in range(3):
        _run(tmp_path, f"z/fedprox_seed{seed}", "fedprox", seed, [0.70 + seed / 1000])
        _run(tmp_path, f"z/fedavg_seed{seed}", "fedavg", seed, [0.60])
    c = render_docs.Archive(tmp_path).claim("z/fedprox_seed*", ref="z/fedavg_seed*", last=1)
    assert render_docs.verdict_scale.separation(c.each) == 1  # t far above 4.30
    assert c.separation == "separates on too few seeds to decide"
    assert c.verdict(_paper(10.0)) == "not decided (3 seeds)"
    for sense in ("separates", "beyond"):
        with pytest.raises(render_docs.RenderError, match="needs 5 seeds"):
            c.says("it separates", sense)
    with pytest.raises(render_docs.RenderError, match="do not support"):
        c.says("within seed noise", "noise")


def test_a_replicate_averages_each_seeds_two_float_paths(archive, tmp_path):
    # the reruns on another float path (engine.threads 2): per seed, differences 10+1, 11-1, 9, 9+2, 12-2
    for seed, (a, b) in enumerate([(0.71, 0.60), (0.71, 0.61), (0.69, 0.60), (0.73, 0.62), (0.71, 0.61)]):
        _run(tmp_path, f"x2/fedprox_seed{seed}", "fedprox", seed, [0.1, a], engine={"threads": 2})
        _run(tmp_path, f"x2/fedavg_seed{seed}", "fedavg", seed, [0.1, b], engine={"threads": 2})
    c = archive.claim("x/fedprox_seed*", ref="x/fedavg_seed*", replicate="x2", last=1)
    assert [round(d, 6) for d in c.each] == [10.5, 10.5, 9.0, 10.0, 11.0]
    assert [round(g, 6) for g in c.gaps] == [-1.0, 1.0, 0.0, -2.0, 2.0] and round(c.spread, 6) == 2.0
    assert (
        str(c)
        == "+10.20 ± 0.76 (5 seeds, each the mean of 2 float paths: +10.50, +10.50, +9.00, +10.00, +11.00)"
    )
    assert len(c.runs) == 20 and c.verdict(_paper(16.0)) == "yes"
    plain = archive.claim("x/fedprox_seed*", ref="x/fedavg_seed*", last=1)
    with pytest.raises(render_docs.RenderError, match="replicate="):
        _ = plain.spread
    with pytest.raises(render_docs.RenderError, match="needs a paired claim"):
        archive.claim("x/fedprox_seed*", replicate="x2", last=1)


def test_a_replicate_must_be_the_same_run_on_another_path(archive, tmp_path):
    def claim(folder: str) -> None:
        render_docs.Archive(tmp_path).claim("x/fedprox_seed*", ref="x/fedavg_seed*", replicate=folder, last=1)

    for seed in range(5):  # the same engine: no second float path
        _run(tmp_path, f"same/fedprox_seed{seed}", "fedprox", seed, [0.1, 0.7])
        _run(tmp_path, f"same/fedavg_seed{seed}", "fedavg", seed, [0.1, 0.6])
    with pytest.raises(render_docs.RenderError, match="not another float path"):
        claim("same")
    for seed in range(5):  # another setting besides the engine
        _run(
            tmp_path,
            f"other/fedprox_seed{seed}",
            "fedprox",
            seed,
            [0.1, 0.7],
            engine={"threads": 2},
            clients=8,
        )
        _run(
            tmp_path, f"other/fedavg_seed{seed}", "fedavg", seed, [0.1, 0.6], engine={"threads": 2}, clients=8
        )
    with pytest.raises(render_docs.RenderError, match="more than engine"):
        claim("other")
    _run(tmp_path, "part/fedprox_seed0", "fedprox", 0, [0.1, 0.7], engine={"threads": 2})
    with pytest.raises(render_docs.RenderError, match="no rerun of fedavg_seed0 in part"):
        claim("part")
    for seed in range(5):  # one rerun from another commit: the claim loses its verdict
        commit = "def" if seed == 4 else "abc"
        _run(tmp_path, f"late/fedprox_seed{seed}", "fedprox", seed, [0.1, 0.7], commit, engine={"threads": 2})
        _run(tmp_path, f"late/fedavg_seed{seed}", "fedavg", seed, [0.1, 0.6], engine={"threads": 2})
    late = render_docs.Archive(tmp_path).claim(
        "x/fedprox_seed*", ref="x/fedavg_seed*", replicate="late", last=1
    )
    assert late.verdict(_paper(16.0)) == "no verdict (runs from commits abc, def)"


def test_a_run_whose_config_repeats_another_is_refused(archive, tmp_path):
    import shutil

    runs = tmp_path / "docs/results/runs/x"
    shutil.copytree(runs / "fedavg_seed0", runs / "fedavg-mu2_seed0")
    with pytest.raises(Exception, match="one run counted twice"):
        render_docs.Archive(tmp_path).claim("x/fedavg*_seed*", last=1)


def test_a_template_holds_no_result_outside_directives():
    text = "A is 3.25 ± 0.50 above FedAvg, which separates.\n\n{{ c.mean|s(2) }} {{ c.says('a', 'x') }}\n"
    problems = render_docs.scan_template(text)
    assert any("3.25" in p for p in problems) and any("'above FedAvg'" in p for p in problems)
    assert any("'separates'" in p for p in problems)
    assert render_docs.scan_template("<!-- not a result: setting -->\n20 rounds x 5 epochs, seed 3.\n") == []
    assert render_docs.scan_template("{{ c }} on P10C2 (`--rounds-to 50`), ResNet-18.\n") == []


def test_an_inline_exemption_covers_its_text_back_to_the_last_directive_only():
    text = "FedX gives 3.25 more {{ c.mean|s(2) }} at momentum 0.9 <!-- not a result: setting -->.\n"
    assert [p.split(":")[2].strip() for p in render_docs.scan_template(text)] == [
        "'3.25' in 'FedX gives 3.25 more .'"
    ]


def test_no_template_says_a_result_outside_its_directives():
    templates = sorted((ROOT / render_docs.TEMPLATES).rglob("*.j2"))
    assert {p.relative_to(ROOT / render_docs.TEMPLATES).as_posix()[:-3] for p in templates} == set(
        render_docs.PAGES
    )
    for path in templates:
        assert render_docs.scan_template(path.read_text()) == [], path


def test_fedpcd_report_counts_every_run_once(archive, tmp_path):
    import shutil

    from fedpcd.errors import UserError
    from fedpcd.report.document import write_report

    runs = tmp_path / "docs/results/runs/x"
    assert "fedprox" in write_report(runs, None, 1)
    shutil.copytree(runs / "fedavg_seed1", runs / "fedavg-copy_seed1")
    with pytest.raises(UserError, match="one run counted twice"):
        write_report(runs, None, 1)


def test_holds_renders_nothing_when_true_and_refuses_the_page_when_false():
    """``holds``: the check behind a comparison the prose words itself ("FedProto has the lowest PA-V")."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.globals["holds"] = render_docs.holds
    page = env.from_string("FedPer is lower{{ holds(a < b, 'FedPer lower') }}.")
    assert page.render(a=70.0, b=75.0) == "FedPer is lower."
    with pytest.raises(render_docs.RenderError, match="do not support: FedPer lower"):
        page.render(a=76.0, b=75.0)


def test_means_gives_each_methods_mean_over_its_seeds(tmp_path):
    """``means``: {method name: mean over seeds of the last-rounds mean}, what backs "the best" in prose."""
    for seed, (mine, theirs) in enumerate(((0.70, 0.60), (0.74, 0.62))):
        _run(tmp_path, f"m/fedprox_seed{seed}", "fedprox", seed, [0.5, mine])
        _run(tmp_path, f"m/fedavg_seed{seed}", "fedavg", seed, [0.5, theirs])
    means = render_docs.Archive(tmp_path).means("m/*_seed*", last=1)
    assert means == pytest.approx({"fedprox": 72.0, "fedavg": 61.0})
    assert render_docs.Archive(tmp_path).means("m/fedavg_seed*", last=2) == pytest.approx({"fedavg": 55.5})


# a superlative or comparative about results is backed beside it by a directive that checks or computes it
SUPERLATIVE = re.compile(
    r"\b(?:the\s+(?:best|highest|lowest|weakest|largest|smallest)|smoothest|swings?\s+least)\b"
)
COMPARATIVE = re.compile(r"\b(?:second-best|lowers?|higher|slower|faster|no better|gains? (?:less|more))\b")
BACKED = ("holds(", "|min", "|max", "dictsort")
NOT_ABOUT_RESULTS = (
    "the best cosine",
    "the best round",
    "the best method in bold",
    "the best value of",
    "lower themselves",  # what a loss can do, not what a run did
    "lowers the intra-class",
    "higher layers",
    "lower-precision",
    "faster kernel",
)


def _ranked(template: str) -> set[str]:
    """The template's variables set from a ranking (sort, min, max), directly or through another such one."""
    sets = re.findall(r"\{%\s*set\s+(\w+)\s*=(.*?)%\}", template, re.S)
    ranked: set[str] = set()
    while True:
        more = {
            name
            for name, value in sets
            if any(b in value for b in (*BACKED, "|sort"))
            or any(re.search(rf"\b{r}\b", value) for r in ranked)
        }
        if more <= ranked:
            return ranked
        ranked |= more


def _exempt(template: str, at: int) -> bool:
    """Whether the scan leaves the text at ``at`` unread: in code, in a block after an exemption line, or
    before an inline exemption with no directive, comment or paragraph end between."""
    before = template[:at]
    if before.count("```") % 2:
        return True
    paragraph = before[before.rfind("\n\n") + 1 :]
    if render_docs.EXEMPT_LINE.match(paragraph.strip().split("\n")[0].strip()):
        return True
    after = template[at:]
    stops = [i for i in (after.find("{{"), after.find("{%"), after.find("\n\n")) if i >= 0]
    comment = after.find("<!--")
    return 0 <= comment < min(stops, default=len(after)) and after[comment:].startswith("<!-- not a result:")


def _unbacked(words: re.Pattern[str], backing: tuple[str, ...]) -> list[str]:
    """Where a template's prose uses one of ``words`` with none of ``backing`` (or a ranked variable) in the
    text around it: file, line and the words nearby."""
    unbacked = []
    for path in sorted((ROOT / render_docs.TEMPLATES).rglob("*.j2")):
        template = path.read_text()
        ranked = _ranked(template)
        for m in words.finditer(template):
            near = template[max(m.start() - 100, 0) : m.end() + 250]
            backed = any(b in near for b in backing) or any(re.search(rf"\{{\{{ {r}\b", near) for r in ranked)
            if (
                not backed
                and not _exempt(template, m.start())
                and not template[m.start() :].startswith(NOT_ABOUT_RESULTS)
            ):
                line = template.count("\n", 0, m.start()) + 1
                unbacked.append(f"{path.name}:{line}: {' '.join(near.split())[60:180]!r}")
    return unbacked


def test_every_superlative_about_results_is_checked_by_a_directive():
    """ "FedAvg-FT gives the best PA-split" was written by hand and was false (FedRep's mean is higher): every
    "the best / highest / lowest / ..." the scan reads has, in its sentence, a ``holds``, a min / max or a
    ranking of the archive that backs it."""
    assert _unbacked(SUPERLATIVE, BACKED) == []


def test_every_comparative_about_results_is_checked_by_a_directive():
    """ "PA-V and PA-G are lower under FedGELA" was written by hand and PA-V was not lower on P10C2: every
    "lower / higher / slower / faster / second-best / gains less" the scan reads has a ``holds``, a signed
    ``says`` or a ranking beside it."""
    assert _unbacked(COMPARATIVE, (*BACKED, "says(")) == []
