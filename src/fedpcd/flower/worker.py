"""A long-lived ClientApp process for a SuperNode started with ``--isolation process``.

By default a SuperNode's SuperExec starts a fresh ``flwr-clientapp`` process for every message; that process
imports torch and rebuilds the federation (10-30 s a message on a small, loaded machine). In flwr 1.41
``flwr-clientapp`` itself serves exactly one message (one token) and exits, so a long-lived process has to
take the SuperExec's place: this worker polls the SuperNode's Runtime API for pending ClientApp tasks
(``AcquireTask``) and runs each one in this process, with the same calls ``flwr-clientapp`` makes (pull the
message and context, run the ClientApp, push the reply and the updated context). Imports and the built
federation are kept, so a round costs its training.

    flower-supernode --isolation process --port 9094 ... &
    python -m fedpcd.flower.worker --runtime-api-address 127.0.0.1:9094 --insecure

It serves fedpcd's ClientApp (``--app`` to change it) for whatever run the SuperNode receives; the app's
code comes from this Python environment, not from the FAB. It uses Flower's runtime client, which is not
a public API: it is written against (and pinned to) flwr 1.41.0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from fedpcd.flower import _env
from fedpcd.procs_guard import exit_when_gone

_env.set_offline_defaults()

DEFAULT_APP = "fedpcd.flower.client_app:app"


def load_app(ref: str) -> Any:
    """``module:attribute`` -> the object (the ClientApp)."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in (attr or "app").split("."):
        obj = getattr(obj, part)
    return obj


def _client(address: str, insecure: bool, root_certificates: bytes | None, interceptors: list[Any]) -> Any:
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=root_certificates,
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def run_task(
    address: str, token: str, client_app: Any, insecure: bool, root_certificates: bytes | None
) -> bool:
    """Serve one task (one message) in this process; returns whether the ClientApp succeeded."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = _client(
        address,
        insecure,
        root_certificates,
        [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token)],
    )
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    context = None
    status, details = SubStatus.FAILED, "the fedpcd worker failed before running the ClientApp"
    try:
        message, context, _run, _fab = pull_task_input(client)
        try:
            reply = client_app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # noqa: BLE001 - becomes an error reply, as in flwr-clientapp
            reason = f"{type(ex)}:<'{ex}'>"
            print(f"fedpcd worker: ClientApp raised {reason}", file=sys.stderr, flush=True)
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
            reply = Message(error, reply_to=message)
            details = reason
        push_message(client, reply, context)
    finally:
        push_task_output(client=client, context=context, sub_status=status, details=details)
        heartbeat.stop()
        client.close()
    return status == SubStatus.COMPLETED


def serve(
    address: str,
    *,
    insecure: bool = False,
    root_certificates: str | None = None,
    app_ref: str = DEFAULT_APP,
    poll: float = 0.2,
    parent_pid: int | None = None,
    max_tasks: int | None = None,
) -> None:
    """Poll the SuperNode at ``address`` for ClientApp tasks and run them here, until stopped."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    if parent_pid is not None:  # no orphan left serving if the launcher dies
        exit_when_gone(parent_pid)
    certs = None if insecure or root_certificates is None else Path(root_certificates).read_bytes()
    client_app = load_app(app_ref)  # imports torch and fedpcd once, before the first task
    acquirer = _client(address, insecure, certs, [RuntimeVersionHttpInterceptor(component_name="SuperExec")])
    print(f"fedpcd worker {os.getpid()}: serving {app_ref} for the SuperNode at {address}", flush=True)
    done = 0
    try:
        while max_tasks is None or done < max_tasks:
            res = acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
            if res.HasField("task") and res.token:
                try:
                    run_task(address, res.token, client_app, insecure, certs)
                except Exception as ex:  # noqa: BLE001 - a failed task must not end the worker
                    print(
                        f"fedpcd worker: task failed outside the ClientApp: {ex!r}",
                        file=sys.stderr,
                        flush=True,
                    )
                done += 1
            else:
                time.sleep(poll)
    finally:
        acquirer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedpcd.flower.worker", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--runtime-api-address",
        default="127.0.0.1:9094",
        help="the SuperNode's Runtime API (its --port), default 127.0.0.1:9094",
    )
    parser.add_argument("--insecure", action="store_true", help="plain HTTP to the SuperNode (no TLS)")
    parser.add_argument(
        "--root-certificates", help="CA certificate to verify the SuperNode's Runtime API TLS"
    )
    parser.add_argument("--app", default=DEFAULT_APP, help=f"ClientApp to serve (default {DEFAULT_APP})")
    parser.add_argument("--poll", type=float, default=0.2, help="seconds between polls for a task")
    parser.add_argument("--parent-pid", type=int, help="exit when this process exits")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        serve(
            args.runtime_api_address,
            insecure=args.insecure,
            root_certificates=args.root_certificates,
            app_ref=args.app,
            poll=args.poll,
            parent_pid=args.parent_pid,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
