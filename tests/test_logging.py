"""fedpcd's log: the stderr lines of each verbosity, run.log (times, levels, appended, re-entrant, the way a
run ended, links refused), and run.log in the run directory of local runs (a Flower run's:
test_flower_processes.py), which a new run or a resume accepts there."""

from __future__ import annotations

import logging
import re

import pytest

from conftest import log_lines
from fedpcd.backends import resume_run, run_experiment
from fedpcd.errors import UserError
from fedpcd.logs import LOGGER, run_log, setup
from fedpcd.resolve import load_config
from fedpcd.run_format import RunFiles

TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=2"]


@pytest.fixture(autouse=True)
def default_verbosity():
    """Each test starts, and leaves the logger, at verbosity 0 (as importing fedpcd.logs sets it)."""
    setup(0)
    yield
    setup(0)


def emit_each_level() -> None:
    LOGGER.debug("d")
    LOGGER.info("i")
    LOGGER.warning("w")
    logging.getLogger("fedpcd.engine").error("e")  # a child logger's lines go the same way


@pytest.mark.parametrize(
    ("verbosity", "shown"),
    [
        (-1, ["fedpcd: warning: w", "fedpcd: error: e"]),
        (0, ["fedpcd: i", "fedpcd: warning: w", "fedpcd: error: e"]),
        (2, ["fedpcd: debug: d", "fedpcd: i", "fedpcd: warning: w", "fedpcd: error: e"]),
    ],
)
def test_verbosity_chooses_the_stderr_lines(capsys, verbosity, shown):
    setup(verbosity)
    setup(verbosity)  # configured once: no second handler, no line twice
    emit_each_level()
    out, err = capsys.readouterr()
    assert (out, err.splitlines()) == ("", shown)
    assert not LOGGER.propagate


def test_run_log_records_every_level_with_its_time_appends_and_nests(tmp_path, capsys):
    setup(-1)  # stderr's verbosity does not limit run.log
    with run_log(tmp_path):
        emit_each_level()
        with run_log(tmp_path):  # a nested block for the same run (a Flower simulation's ServerApp)
            LOGGER.info("nested")
    LOGGER.info("after the block")  # not in run.log
    with run_log(tmp_path):  # a resume: appended
        LOGGER.info("again")
    lines = log_lines(RunFiles(tmp_path).run_log)
    assert [level for level, _ in lines] == ["INFO", "DEBUG", "INFO", "WARNING", "ERROR", "INFO", "INFO"] + [
        "INFO",
        "INFO",
        "INFO",
    ]
    assert re.fullmatch(rf"fedpcd \S+, pid \d+: run {re.escape(str(tmp_path.resolve()))}", lines[0][1])
    assert [m for _, m in lines[1:7]] == ["d", "i", "w", "e", "nested", "finished"]
    assert lines[7][1].startswith("fedpcd ") and [m for _, m in lines[8:]] == ["again", "finished"]
    assert capsys.readouterr().err.splitlines() == ["fedpcd: warning: w", "fedpcd: error: e"]
    path = str(RunFiles(tmp_path).run_log.resolve())
    assert all(getattr(h, "baseFilename", None) != path for h in LOGGER.handlers)  # removed after the block


@pytest.mark.parametrize(
    ("error", "ending", "traceback"),
    [
        (UserError("bad value for 'rounds'"), ("ERROR", "stopped: bad value for 'rounds'"), False),
        (RuntimeError("diverged"), ("ERROR", "stopped: RuntimeError: diverged"), True),
        (KeyboardInterrupt(), ("WARNING", "interrupted"), False),
    ],
)
def test_run_log_says_how_the_run_ended(tmp_path, capsys, error, ending, traceback):
    with pytest.raises(type(error)), run_log(tmp_path):
        raise error
    path = RunFiles(tmp_path).run_log
    assert log_lines(path)[-1] == ending
    assert ("Traceback (most recent call last)" in path.read_text()) is traceback
    assert capsys.readouterr().err == ""  # the command line reports the error itself, once


def test_run_log_never_writes_through_a_link(tmp_path, capsys):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    RunFiles(out).run_log.symlink_to(target)
    with pytest.raises(UserError, match="^cannot write .*run.log: "), run_log(out):
        pass
    config = load_config(None, [*TINY, "rounds=1", f"output_dir={out}"])
    with pytest.raises(UserError, match=f"^{re.escape(str(out / 'run.log'))} is a symbolic link"):
        run_experiment(config, progress=False)
    assert target.read_text() == "precious\n" and not RunFiles(out).config.exists()


def test_a_local_run_and_its_resume_write_run_log(tmp_path, capsys):
    out = tmp_path / "run"
    config = load_config(None, [*TINY, "rounds=2", "eval_every=1", f"output_dir={out}"])
    run_experiment(config, progress=False)
    assert capsys.readouterr().err == ""  # verbosity 0, no progress: nothing on stderr
    text = (out / "config.yaml").read_text().replace("rounds: 2", "rounds: 3")
    (out / "config.yaml").write_text(text)
    resume_run(out, progress=False, allow_changes=["rounds"])
    messages = [m for _, m in log_lines(RunFiles(out).run_log)]
    rounds = [m.split(":")[0] for m in messages if re.match(r"round \d+: GA=", m)]
    assert rounds == ["round 1", "round 2", "round 3"]  # each round once: the resume appended
    assert messages.count("finished") == 2 and f"resuming {out} from round 2 of 3" in messages
    assert messages.index(f"resuming {out} from round 2 of 3") > messages.index("finished")
    assert any(m.startswith(f"starting {out}: fedavg on synthetic, 2 clients, 2 rounds") for m in messages)


def test_run_log_left_by_a_run_stopped_before_its_files_is_not_foreign(tmp_path):
    """A run that failed before writing config.yaml leaves .lock and run.log: the same command runs there."""
    out = tmp_path / "run"
    bad = load_config(None, [*TINY, "rounds=1", "dataset.name=cifar10", f"output_dir={out}"])
    bad.dataset.root = str(tmp_path / "nowhere")
    bad.dataset.download = False
    with pytest.raises(UserError):
        run_experiment(bad, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock", "run.log"]
    run_experiment(load_config(None, [*TINY, "rounds=1", f"output_dir={out}"]), progress=False)
    assert RunFiles(out).summary.exists()
    assert [m for level, m in log_lines(RunFiles(out).run_log) if level == "ERROR"][0].startswith("stopped: ")
