"""A real Flower deployment on this machine's loopback: one SuperLink, N SuperNodes, long-lived workers.

    with LoopbackDeployment(num_nodes=2) as dep:      # starts everything on 127.0.0.1, free ports
        summary = dep.run(config)                      # `flwr run` of the fedpcd app; waits; the summary
    # leaving the block stops every process it started (by pid, SIGTERM then SIGKILL) and checks they are gone

Each SuperNode serves one partition (``--node-config "partition-id=i num-partitions=N"``) and runs with
``--isolation process``; next to it a :mod:`fedpcd.flower.worker` process executes its ClientApp messages
(imports and the federation stay loaded, so a round costs its training). ``long_lived=False`` keeps
Flower's default instead (a fresh ``flwr-clientapp`` process per message), for comparison.

Everything binds to 127.0.0.1; the communication is plain HTTP (``--insecure``), or TLS with ``tls=True``
(a throwaway CA and server certificate for 127.0.0.1 are generated in the working directory). Each
component gets its own FLWR_HOME inside a temporary working directory, removed on stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fedpcd.config import Config
from fedpcd.config_identity import dump_config
from fedpcd.errors import UserError
from fedpcd.flower import _env, procs
from fedpcd.run_format import RunFiles

CONNECTION = "fedpcd-loopback"

APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedpcd-app"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedpcd"

[tool.flwr.app.components]
serverapp = "fedpcd.flower.server_app:app"
clientapp = "fedpcd.flower.client_app:app"

[tool.flwr.app.config]
config-file = ""
overrides = ""
node-timeout = 300
"""


def executable(name: str) -> str:
    """A Flower command from this Python environment (beside ``sys.executable``), else from PATH."""
    sibling = Path(sys.executable).parent / name
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    found = shutil.which(name)
    if found is None:
        raise UserError(
            f"{name} not found (neither beside {sys.executable} nor on PATH); pip install '{_env.FLWR_PIN}'"
        )
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_env.LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    """Wait until 127.0.0.1:port accepts connections (fail early if ``proc`` exits)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what or proc.args[0]} exited with code {proc.returncode} while starting")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((_env.LOOPBACK, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what or 'a process'} did not open 127.0.0.1:{port} within {timeout:.0f} s")


def make_certificates(directory: Path, host: str = _env.LOOPBACK) -> dict[str, Path]:
    """A throwaway CA plus a server certificate for ``host`` and localhost (trustme; PEM files ca.crt,
    server.pem, server.key), for this loopback deployment only."""
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cert = ca.issue_cert(host, "localhost")
    files = {"ca": directory / "ca.crt", "cert": directory / "server.pem", "key": directory / "server.key"}
    ca.cert_pem.write_to_path(files["ca"])
    cert.cert_chain_pems[0].write_to_path(files["cert"])
    cert.private_key_pem.write_to_path(files["key"])
    return files


@dataclass
class Started:
    """One process this deployment started."""

    name: str
    popen: subprocess.Popen
    proc: procs.Proc
    log: Path
    handle: IO[bytes] = field(repr=False)


class LoopbackDeployment:
    """SuperLink + ``num_nodes`` SuperNodes (+ one long-lived ClientApp worker each) on 127.0.0.1."""

    def __init__(
        self,
        num_nodes: int,
        *,
        long_lived: bool = True,
        tls: bool = False,
        workdir: str | Path | None = None,
        keep: bool = False,
        cwd: str | Path | None = None,
        data_root: str | None = None,
    ) -> None:
        if num_nodes < 1:
            raise UserError("a deployment needs at least one SuperNode")
        self.num_nodes = num_nodes
        self.long_lived = long_lived
        self.tls = tls
        self.keep = keep or workdir is not None
        self.base = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="fedpcd-deploy-"))
        self.base.mkdir(parents=True, exist_ok=True)
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.data_root = data_root
        self.started: list[Started] = []
        self.link_port = 0
        self.node_ports: list[int] = []
        self.certs: dict[str, Path] = {}

    # ----- processes -----
    def _env(self, home: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(_env.OFFLINE_ENV)
        env.update(FLWR_HOME=str(self.base / home), PYTHONUNBUFFERED="1", UV_CACHE_DIR=str(self.base / "uv"))
        # Flower starts its helpers (flower-superexec, flwr-serverapp) by name: from this environment first
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        (self.base / home).mkdir(parents=True, exist_ok=True)
        return env

    def _spawn(self, name: str, cmd: list[str], home: str) -> Started:
        log = self.base / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(log, "wb")  # noqa: SIM115 - closed in stop()
        popen = subprocess.Popen(
            cmd,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=self._env(home),
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
        )
        ident = procs.identity(popen.pid) or (popen.pid, 0)
        started = Started(name, popen, ident, log, handle)
        self.started.append(started)
        return started

    def _tls_link(self) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        c = self.certs
        return [
            "--ssl-ca-certfile",
            str(c["ca"]),
            "--ssl-certfile",
            str(c["cert"]),
            "--ssl-keyfile",
            str(c["key"]),
        ]

    def start(self, timeout: float = 90.0) -> LoopbackDeployment:
        """Start the SuperLink, the SuperNodes and the workers; return once their ports are open."""
        _env.require_flwr()
        superlink, supernode = executable("flower-superlink"), executable("flower-supernode")
        if self.tls:
            self.certs = make_certificates(self.base / "certs")
        try:
            self.link_port = free_port()
            link = self._spawn(
                "superlink",
                [
                    superlink,
                    *self._tls_link(),
                    "--host",
                    _env.LOOPBACK,
                    "--port",
                    str(self.link_port),
                    "--disable-runtime-dependency-installation",
                ],
                "superlink",
            )
            wait_for_port(self.link_port, timeout, link.popen, "flower-superlink")
            node_tls = ["--root-certificates", str(self.certs["ca"])] if self.tls else ["--insecure"]
            nodes = []
            for i in range(self.num_nodes):
                port = free_port()
                self.node_ports.append(port)
                node_config = f"partition-id={i} num-partitions={self.num_nodes}"
                if self.data_root:
                    node_config += f' data-root="{self.data_root}"'
                isolation = ["--isolation", "process"] if self.long_lived else []
                nodes.append(
                    (
                        port,
                        self._spawn(
                            f"supernode-{i}",
                            [
                                supernode,
                                *node_tls,
                                "--superlink",
                                f"{_env.LOOPBACK}:{self.link_port}",
                                "--host",
                                _env.LOOPBACK,
                                "--port",
                                str(port),
                                *isolation,
                                "--node-config",
                                node_config,
                            ],
                            f"supernode-{i}",
                        ),
                    )
                )
            for i, (port, node) in enumerate(nodes):
                wait_for_port(port, timeout, node.popen, f"flower-supernode {i}")
                if self.long_lived:  # the node's Runtime API is local to its machine: plain HTTP on loopback
                    self._spawn(
                        f"worker-{i}",
                        [
                            sys.executable,
                            "-m",
                            "fedpcd.flower.worker",
                            "--insecure",
                            "--runtime-api-address",
                            f"{_env.LOOPBACK}:{port}",
                            "--parent-pid",
                            str(os.getpid()),
                        ],
                        f"supernode-{i}",
                    )
            self._write_cli_config()
        except RuntimeError as exc:
            self.keep = True  # the logs say why
            self.stop()
            raise RuntimeError(f"{exc}; logs in {self.base / 'logs'}") from exc
        except BaseException:
            self.stop()
            raise
        return self

    def _write_cli_config(self) -> None:
        lines = [
            "[superlink]",
            f'default = "{CONNECTION}"',
            "",
            f"[superlink.{CONNECTION}]",
            f'address = "{_env.LOOPBACK}:{self.link_port}"',
        ]
        lines.append(f'root-certificates = "{self.certs["ca"]}"' if self.tls else "insecure = true")
        (self.base / "cli").mkdir(parents=True, exist_ok=True)
        (self.base / "cli" / "config.toml").write_text("\n".join(lines) + "\n")

    @property
    def pids(self) -> list[int]:
        """Process ids of what this deployment started itself (SuperLink, SuperNodes, workers)."""
        return [s.proc[0] for s in self.started]

    def all_processes(self) -> set[procs.Proc]:
        """The started processes and every live descendant (the SuperExecs, flwr-serverapp, ...)."""
        out: set[procs.Proc] = set()
        for s in self.started:
            if procs.alive(s.proc):
                out.add(s.proc)
                out |= procs.descendants(s.proc[0])
        return out

    def stop(self, timeout: float = 15.0) -> None:
        """Stop workers, SuperNodes, then the SuperLink (with their children) by pid; check they are gone."""
        leftover: list[procs.Proc] = []
        for group in (("worker",), ("supernode",), ("superlink",)):
            mine = [s for s in self.started if s.name.startswith(group)]
            targets: set[procs.Proc] = set()
            for s in mine:
                if procs.alive(s.proc):
                    targets |= {s.proc} | procs.descendants(s.proc[0])
            leftover += procs.stop(targets, timeout)
            for s in mine:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    s.popen.wait(timeout=1)  # reap it: no zombie left behind
                s.handle.close()
        self.started = [s for s in self.started if procs.alive(s.proc)]
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)
        if leftover:  # pragma: no cover - depends on the OS
            raise RuntimeError(f"could not stop processes {sorted(p for p, _ in leftover)}")

    def __enter__(self) -> LoopbackDeployment:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.keep = True  # leave the logs for the error message to point at
        self.stop()

    # ----- runs -----
    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI against this deployment's SuperLink."""
        return subprocess.run(
            [executable("flwr"), *args],
            env=self._env("cli"),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def submit(self, app_dir: str | Path, run_config: dict[str, Any]) -> int:
        """``flwr run APP`` with ``run_config`` (values quoted for Flower); returns the run id."""
        items = []
        for key, value in run_config.items():
            items.append(f"{key}={json.dumps(value) if isinstance(value, str) else value}")
        res = self.flwr("run", str(app_dir), CONNECTION, "--run-config", " ".join(items), "--format", "json")
        try:
            out = json.loads(res.stdout)
        except json.JSONDecodeError:
            out = {}
        if res.returncode != 0 or not out.get("success"):
            raise RuntimeError(
                f"flwr run failed (code {res.returncode}): {res.stdout.strip()} {res.stderr.strip()}"
            )
        return int(out["run-id"])

    def status(self, run_id: int) -> dict[str, Any]:
        """The run's entry of ``flwr ls --run-id`` (status ``pending``/``running``/``finished:...``)."""
        res = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        try:
            runs = json.loads(res.stdout).get("runs", [])
        except json.JSONDecodeError:
            runs = []
        return runs[0] if runs else {"status": "unknown", "status-details": res.stdout + res.stderr}

    def wait(
        self, run_id: int, summary_path: Path, timeout: float, check_every: float = 20.0
    ) -> dict[str, Any]:
        """Wait for the run: the summary file appearing, or Flower reporting it finished (failed)."""
        end = time.monotonic() + timeout
        next_check = time.monotonic() + check_every
        while time.monotonic() < end:
            if summary_path.exists():
                while time.monotonic() < end:  # the ServerApp returns right after writing it
                    st = self.status(run_id)
                    if st["status"].startswith("finished"):
                        return st
                    time.sleep(1.0)
                break
            if time.monotonic() > next_check:  # a `flwr` call costs ~1 s of CPU: not too often
                st = self.status(run_id)
                if st["status"].startswith("finished"):
                    return st
                next_check = time.monotonic() + check_every
            time.sleep(0.5)
        raise RuntimeError(
            f"Flower run {run_id} did not finish within {timeout:.0f} s; logs in {self.base / 'logs'}"
        )

    def run(
        self,
        config: Config,
        app_dir: str | Path | None = None,
        timeout: float = 1800.0,
        node_timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Run a resolved config on this deployment through ``flwr run``; returns the run's summary.

        ``config.clients`` must equal ``num_nodes``. ``output_dir`` is made absolute (the ServerApp runs in a
        process of the SuperLink). ``app_dir``: a Flower app directory (default: a minimal one written here).
        """
        if config.clients != self.num_nodes:
            raise UserError(
                f"config has clients={config.clients} but this deployment has {self.num_nodes} SuperNodes"
            )
        out = RunFiles((self.cwd / config.output_dir).resolve())
        config = config.model_copy(update={"output_dir": str(out.path), "backend": "flower"})
        cfg_file = self.base / "runs" / f"config-{time.time_ns()}.yaml"
        cfg_file.parent.mkdir(parents=True, exist_ok=True)
        dump_config(config, cfg_file)
        if app_dir is None:
            app_dir = self.base / "app"
            app_dir.mkdir(exist_ok=True)
            (app_dir / "pyproject.toml").write_text(APP_PYPROJECT)
        run_id = self.submit(
            app_dir, {"config-file": str(cfg_file), "overrides": "", "node-timeout": int(node_timeout)}
        )
        st = self.wait(run_id, out.summary, timeout)
        if st["status"] != "finished:completed":
            raise RuntimeError(
                f"Flower run {run_id} ended {st['status']}: {st.get('status-details')}; "
                f"logs in {self.base / 'logs'}"
            )
        return json.loads(out.summary.read_text())
