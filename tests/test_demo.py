"""`fedpcd demo`: FedAvg and the five papers' methods on Fashion-MNIST P10C2, a table that explains itself and
a curve plot titled with the setting."""

from __future__ import annotations

from conftest import requires_fmnist
from fedpcd.cli import main
from fedpcd.demo import DEMO_METHODS, FEDSC_NOTE, FEDSSA_NOTE, leader_sentence, plot_demo_curves


@requires_fmnist
def test_demo_compares_fedavg_and_the_five_methods(tmp_path, capsys):
    overrides = ["rounds=2", "eval_every=1", "dataset.train_fraction=0.02", "personal_test=split"]
    assert main(["demo", "--out", str(tmp_path), "--quiet", *overrides]) == 0
    out, err = capsys.readouterr()
    names = [name for name, _ in DEMO_METHODS]
    assert names == ["fedavg", "fedgela", "fedmr", "fednh", "fedsc", "fedssa"]
    lines = out.splitlines()
    assert lines[0].startswith("Setting: fmnist P10C2 (2% of the train set), simplecnn, 2 rounds x 1 epoch")
    assert "mean over the last 2 evaluated rounds (of 2" in lines[1]
    assert lines[2].split()[:3] == ["algorithm", "GA", "PA-split"]
    assert [line.split()[0] for line in lines[4:10]] == names
    assert lines[9].split()[1] == "-"  # FedSSA: no GA
    text = " ".join(out.split())
    assert "fedsc cpdr_weight=0.01" in out
    assert "PA-G: personal models on the full test set" in text and "2 of 10 classes" in text
    assert "GA: " in text and " leads with " in text and "PA-split: " in text
    assert " ".join(FEDSSA_NOTE.split()) in text and " ".join(FEDSC_NOTE.split()) in text
    assert all((tmp_path / name / "summary.json").exists() for name in names)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    heads = [line for line in err.splitlines() if line.startswith("== ")]
    assert [h.split(":")[0] for h in heads] == [f"== method {i}/6" for i in range(1, 7)]
    assert heads[0] == f"== method 1/6: fedavg: {lines[0].removeprefix('Setting: ').rstrip('.')}"
    assert all(" (demo ETA: about " in h and " for the " in h for h in heads[1:]), heads
    # a second call reuses the finished runs instead of refusing their folders, and says so
    assert main(["demo", "--out", str(tmp_path), "--quiet", *overrides]) == 0
    again = capsys.readouterr()
    assert again.out.splitlines()[4:10] == lines[4:10]
    assert [line for line in again.err.splitlines() if line.startswith("== ")] == [
        f"== method {i}/6: {name}: reused finished run in {tmp_path / name}"
        for i, name in enumerate(names, 1)
    ]


def test_leader_sentence_weighs_the_lead_against_the_swing():
    means = {"a": 0.80, "b": 0.75, "c": 0.5}
    clear = leader_sentence("GA", means, {"a": 0.02})
    assert clear == (
        "GA: a leads with 80.0%, 5.0 points above b; its GA moved by 2.0 points over those rounds, so the"
        " lead is more than the round-to-round swing."
    )
    noisy = leader_sentence("GA", means, {"a": 0.10})
    assert "within the round-to-round swing (not a finding on one seed)" in noisy
    assert leader_sentence("GA", {}, {}) == "GA: no method has a value."


def test_curves_have_a_title_one_legend_per_panel_and_one_y_range(tmp_path):
    rows = [{"round": t, "global_acc": 0.1 * t, "personal_acc": 0.2 * t} for t in (1, 2)]
    no_ga = [{"round": t, "global_acc": None, "personal_acc": 0.9} for t in (1, 2)]
    fig = plot_demo_curves({"fedavg": rows, "fedssa": no_ga}, "fmnist P10C2", tmp_path / "c.png")
    ga, pa = fig.axes
    assert fig._suptitle.get_text() == "fmnist P10C2"
    assert [t.get_text() for t in ga.get_legend().get_texts()] == ["fedavg"]
    assert [t.get_text() for t in pa.get_legend().get_texts()] == ["fedavg", "fedssa"]
    assert ga.get_ylim() == pa.get_ylim()
    assert ga.get_lines()[0].get_color() == pa.get_lines()[0].get_color()


def test_eta_extrapolates_the_finished_methods():
    from fedpcd.demo import eta

    assert eta([], 6) == ""  # nothing finished yet: no estimate
    assert eta([15.0], 4) == (
        " (demo ETA: about 60 s for the 4 methods left, at the mean time of the one finished)"
    )
    assert eta([100.0, 140.0], 4) == (
        " (demo ETA: about 8 min for the 4 methods left, at the mean time of the 2 finished)"
    )
    assert eta([30.0], 1) == (  # the last method: singular
        " (demo ETA: about 30 s for the one method left, at the mean time of the one finished)"
    )
