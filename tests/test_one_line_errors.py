"""Failures the command line states in one line (exit code 2, no traceback): a full disk, a denied
permission, a name too long, memory run out (a MemoryError, a library that cannot map, ``ulimit -v``), shared
memory that cannot grow, plugins that exit on import, YAML with duplicate keys or over the size limits (also
inside a Flower message), and control characters escaped on the terminal."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys

import pytest

from conftest import SRC, TINY, cli_main, install_plugin, one_error_line, start_cli
from fedpcd import procs_guard
from fedpcd.cli import main
from fedpcd.config_input import MAX_CONFIG_BYTES
from fedpcd.errors import UserError
from fedpcd.procs_guard import out_of_memory_line
from fedpcd.resolve import load_config
from fedpcd.utils import show_text

RUN = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=2"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("fedpcd: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


_FULL = (
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write "
    "failed"
)


def test_disk_full_during_the_checkpoint_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """torch's zip writer reports the short write of a full disk as a RuntimeError: one line naming the
    checkpoint file; no temp file left, round 1's metrics kept; a resume after space is freed finishes."""
    import torch

    import fedpcd.engine.rundir as rundir

    real_save = torch.save

    def full(obj, fh, *args, **kwargs):
        if isinstance(obj, dict) and "client_states" in obj:  # the checkpoint, not a client state
            fh.write(b"PK\x03\x04 partial")
            raise RuntimeError(_FULL)
        return real_save(obj, fh, *args, **kwargs)

    class NoSpace:
        f_bavail, f_frsize = 12, 4096

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(rundir.os, "fstatvfs", lambda fd: NoSpace)
    out = tmp_path / "run"
    assert main(["run", "--quiet", *RUN, "rounds=2", "engine.workers=1", f"output_dir={out}"]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: cannot write {out}/checkpoint/state.pt: No space left on device"
    )
    assert os.listdir(out / "checkpoint") == []
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert (out / "summary.json").exists()


def test_a_torch_error_that_is_no_write_failure_is_left_as_it_is(tmp_path, monkeypatch):
    import torch

    from fedpcd.engine.rundir import save_tensors

    monkeypatch.setattr(torch, "save", lambda obj, fh: (_ for _ in ()).throw(RuntimeError("a bug")))
    with open(tmp_path / "x", "wb") as fh, pytest.raises(RuntimeError, match="a bug"):
        save_tensors({}, fh)


def test_permission_denied_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys):
    """As root a mode-000 folder is readable: the PermissionError it gives other users is injected."""
    import errno

    from fedpcd.engine.rundir import RunDir

    out = tmp_path / "locked" / "run"

    def denied(self, config=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

    monkeypatch.setattr(RunDir, "check_new", denied)
    assert main(["run", "--quiet", *RUN, "rounds=1", f"output_dir={out}"]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: cannot access {out}: Permission denied; give this user access to it, or choose "
        "another path"
    )


def test_a_name_over_255_bytes_is_one_line(tmp_path, capsys):
    out = tmp_path / ("é" * 130) / "run"  # 260 bytes in UTF-8
    assert main(["run", "--quiet", *RUN, "rounds=1", f"output_dir={out}"]) == 2
    err = _error_line(capsys)
    assert "File name too long" in err and "a name in the path is over 255 bytes" in err
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    import fedpcd.backends

    def exhausted(config, progress=True):
        raise MemoryError

    monkeypatch.setattr(fedpcd.backends, "run_experiment", exhausted)
    assert main(["run", "--quiet", *RUN, f"output_dir={tmp_path / 'run'}"]) == 2
    assert _error_line(capsys).startswith(
        "fedpcd: error: out of memory; free memory, or make the run smaller"
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("seed: 1\nrounds: 2\nseed: 3\n", "gives the key 'seed' twice (lines 1 and 3); keep one of them"),
        ("partition: {scheme: iid, scheme: dirichlet}\n", "gives the key 'scheme' twice (line 1)"),
        ("seed: [" + "1, " * 20_000 + "1]\n", "has a list or mapping of more than 10000 entries (line 1)"),
        ("seed: 1\n" + "#" * 300_000 + "\n", "is over 256 KiB; a config holds settings, not data"),
    ],
)
def test_yaml_duplicate_keys_and_sizes_are_refused(tmp_path, capsys, text, error):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["run", "--config", str(path)]) == 2
    assert _error_line(capsys).startswith(f"fedpcd: error: config file {path} {error}")


def test_an_override_with_a_duplicate_key_is_refused(capsys):
    assert main(["run", "partition={scheme: iid, scheme: dirichlet}"]) == 2
    assert _error_line(capsys) == (
        "fedpcd: error: override 'partition' gives the key 'scheme' twice (line 1); keep one of them"
    )


@pytest.mark.parametrize(
    ("code", "raised"),
    [("import sys\nsys.exit(0)", "SystemExit: 0"), ("raise BaseException('odd')", "BaseException: odd")],
)
def test_a_plugin_exiting_on_import_is_one_line_exit_2(tmp_path, monkeypatch, capsys, code, raised):
    from importlib.metadata import EntryPoint

    import fedpcd.registry
    from fedpcd.algorithms import ALGORITHMS

    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))
    monkeypatch.setattr(ALGORITHMS, "_plugins_loaded", False)
    monkeypatch.setattr(ALGORITHMS, "_plugin_error", None)
    module = f"fedpcd_test_exits_{abs(hash(code))}"
    (tmp_path / f"{module}.py").write_text(code + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = EntryPoint("exits", module, "fedpcd.algorithms")
    monkeypatch.setattr(
        fedpcd.registry, "entry_points", lambda group: [plugin] if group == "fedpcd.algorithms" else []
    )
    assert main(["run", "--quiet", *RUN, "rounds=1", f"output_dir={tmp_path / 'run'}"]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: plugin 'exits' (fedpcd.algorithms = {module}) failed to load: {raised}"
    )
    assert not (tmp_path / "run").exists()
    sys.modules.pop(module, None)


SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


SMALLER_RUN = (
    "make the run smaller (fewer clients per round, a smaller local.batch_size or model, engine.workers=1, "
    "fewer sweep --jobs)"
)


@pytest.fixture
def no_limit(monkeypatch):
    monkeypatch.setattr(procs_guard, "_address_space_limit", lambda: None)


@pytest.fixture
def limit_600_mib(monkeypatch):
    monkeypatch.setattr(procs_guard, "_address_space_limit", lambda: 600 * 2**20)


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised from ``inner`` (as numpy raises its ImportError from the extension's error)."""
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


NOT_MAPPED = ImportError("libtorch_cpu.so: failed to map segment from shared object")


def test_memory_errors_are_recognised_through_their_chain(no_limit):
    line = f"out of memory; free memory, or {SMALLER_RUN}"
    assert out_of_memory_line(MemoryError()) == line
    assert out_of_memory_line(OSError(errno.ENOMEM, "Cannot allocate memory")) == line
    assert out_of_memory_line(_chained(ImportError("numpy C-extensions failed"), MemoryError())) == line
    assert out_of_memory_line(_chained(RuntimeError("wrapped"), OSError(errno.ENOMEM, "x"))) == line
    torch_cpu = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    assert out_of_memory_line(torch_cpu) == line
    assert out_of_memory_line(ImportError("libc10.so: cannot allocate memory")) == line
    # not memory: other errors, other errnos, a library that cannot be mapped without a limit (noexec mount)
    for exc in (
        ValueError("cannot allocate memory"),
        OSError(errno.ENOSPC, "No space left on device"),
        ImportError("No module named 'torch'"),
        NOT_MAPPED,
        SystemError("error return without exception set"),
        _chained(RuntimeError("x"), KeyError("y")),
    ):
        assert out_of_memory_line(exc) is None, exc


def test_under_an_address_space_limit_the_line_names_it(limit_600_mib):
    line = (
        "out of memory: this process may use at most 600 MiB of address space (ulimit -v or -d); raise that "
        f"limit, or {SMALLER_RUN}"
    )
    assert out_of_memory_line(NOT_MAPPED) == line
    assert out_of_memory_line(
        SystemError("<function _find_and_load> returned NULL without setting an exception")
    )
    assert out_of_memory_line(MemoryError()) == line
    assert out_of_memory_line(ImportError("No module named 'torch'")) is None


@pytest.mark.slow
def test_the_address_space_limit_is_read_from_the_process():
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 40, resource.RLIM_INFINITY)); "
        "from fedpcd import procs_guard; print(procs_guard._address_space_limit())"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and hard < 1 << 40:
        pytest.skip("this process's hard address-space limit is below 1 TiB")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(1 << 40)


@pytest.mark.slow
def test_a_run_under_ulimit_v_too_small_for_torch_is_one_line(tmp_path):
    """``ulimit -v 358400`` (350 MiB): importing torch fails to map libtorch (an ImportError); the command
    says memory ran out and what the limit is, in one line, with exit code 2 (it used to be a traceback)."""
    limit = 350 * 2**20

    def small_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    out = tmp_path / "run"
    proc = start_cli(
        ["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={out}"],
        tmp_path,
        preexec_fn=small_address_space,
    )
    assert proc.wait(timeout=300) == 2
    assert (tmp_path / "stderr.txt").read_text() == (
        "fedpcd: error: out of memory: this process may use at most 350 MiB of address space (ulimit -v or "
        f"-d); raise that limit, or {SMALLER_RUN}\n"
    )
    assert not out.exists()


@pytest.fixture
def flower_message(monkeypatch):
    """A QUERY (discovery) message carrying ``text`` as the run's config, as the ServerApp sends it."""
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedpcd.flower.protocol import DISCOVER, TASK

    for attr, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    def make(text: str):
        task = ConfigRecord({"action": DISCOVER, "config": text})
        msg = Message(RecordDict({TASK: task}), message_type=MessageType.QUERY, dst_node_id=1)
        msg.metadata.__dict__["_message_id"] = "m"
        return msg

    return make


def _discover_error(msg) -> UserError:
    """What the ServerApp makes of the ClientApp's error reply to ``msg`` (one node, partition 0)."""
    from flwr.app import Context, Message, RecordDict
    from flwr.app.error import Error

    from fedpcd.flower.client_app import app
    from fedpcd.flower.protocol import raise_for_error

    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    with pytest.raises(UserError) as raised:
        app(msg, context)
    ex = raised.value
    reply = Message(Error(code=0, reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg)  # as Flower's runtimes do
    with pytest.raises(UserError) as server_side:
        raise_for_error(reply, "node 1")
    return server_side.value


def test_the_config_in_a_message_is_read_with_the_config_file_limits(flower_message):
    from fedpcd.flower.protocol import config_from_text, config_text

    config = load_config(None, [*SMALL, "clients=2", "rounds=3"])
    text = config_text(config)
    assert config_from_text(text) == config  # the round trip still holds
    first = 1 + text.splitlines().index("rounds: 3")
    twice = text + "rounds: 300\n"
    assert str(_discover_error(flower_message(twice))) == (
        f"node 1: the run's config in this message gives the key 'rounds' twice (lines {first} and "
        f"{len(twice.splitlines())}); keep one of them"
    )
    oversized = text + "# " + "x" * MAX_CONFIG_BYTES + "\n"
    assert str(_discover_error(flower_message(oversized))) == (
        f"node 1: the run's config in this message is over {MAX_CONFIG_BYTES // 1024} KiB, the limit of a "
        "config file"
    )
    aliased = text.replace("name: synthetic", "name: &d synthetic", 1) + "extra: *d\n"
    with pytest.raises(UserError, match=r"^the run's config in this message uses the YAML alias \*d .*"):
        config_from_text(aliased)
    with pytest.raises(
        UserError, match=r"^the run's config in this message must hold a mapping of keys, got"
    ):
        config_from_text("- 1\n- 2\n")
    with pytest.raises(UserError, match=r"^the run's config in this message is not valid YAML$"):
        config_from_text("a: [1\n")


def test_show_text_escapes_every_control_character_and_keeps_printable_text():
    assert show_text("runs/ä b") == "runs/ä b"
    assert show_text("a\x1b[31mred\nb\r\u202e") == "a\\x1b[31mred\\nb\\r\\u202e"
    assert show_text(ValueError("x\ty")) == "x\\ty"


def test_an_output_dir_with_an_escape_sequence_is_printed_escaped(tmp_path):
    out = tmp_path / "a\x1b[2Jb"
    proc = cli_main(["run", "--quiet", *TINY, "rounds=1", f"output_dir={out}"])
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x1b" not in proc.stderr
    assert f"run directory: {tmp_path}/a\\x1b[2Jb  (" in proc.stdout
    line = one_error_line(cli_main(["run", "--quiet", *TINY, "rounds=1", f"output_dir={out}"]))
    assert "\x1b" not in line and "a\\x1b[2Jb" in line  # already holds a run: the error line is escaped too


def test_a_plugin_calling_os_exit_at_import_is_a_failed_plugin_not_a_silent_exit_0(tmp_path):
    site = tmp_path / "site"
    install_plugin(site, "import os\nos._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{site}"}
    proc = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "run", *TINY, "rounds=1", f"output_dir={tmp_path / 'r'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert one_error_line(proc) == (
        "fedpcd: error: plugin 'exit' (fedpcd.models = fedpcd_exit from fedpcd-exit) failed to load: "
        "PluginExit: it called os._exit(0) while imported"
    )


def test_a_shared_memory_file_that_cannot_grow_is_one_line():
    from fedpcd.procs_guard import out_of_memory_line

    exc = RuntimeError(
        "unable to resize file </torch_7499_2285932653_4> to the right size: File too large (27)"
    )
    line = out_of_memory_line(exc)
    assert line is not None and line.startswith(
        "out of shared memory: tensors sent to worker processes did not fit in /dev/shm (full, or over the "
        "file size limit, ulimit -f); free space there, or make the run smaller"
    )
    assert out_of_memory_line(RuntimeError("unable to open file")) is None
