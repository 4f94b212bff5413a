"""What the fedpcd ServerApp and ClientApp say to each other (record names and the run's config text).

Every message carries a ConfigRecord ``fedpcd`` (the task: round, client id, evaluate flag and the run's
resolved config as YAML, so any ClientApp process can rebuild the identical federation). Dicts of the
algorithm contract travel through :mod:`fedpcd.flower.codec` under these names:

- ``payload``: ``algorithm.payload_for(server, k)`` (server -> client k);
- ``reply``: the client's reply to ``aggregate``; ``personal``: its personal metrics (None if not evaluated);
- ``state``: the client state, kept in ``context.state`` on the node. It leaves the node only for a
  checkpoint (QUERY ``get-state``) and comes back on resume (QUERY ``set-state``).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from fedpcd.config import Config
from fedpcd.config_input import MAX_CONFIG_BYTES, YamlRefused, load_yaml
from fedpcd.errors import UserError

TASK = "fedpcd"
PAYLOAD = "payload"
REPLY = "reply"
PERSONAL = "personal"
STATE = "state"
DISCOVER = "discover"  # QUERY actions
GET_STATE = "get-state"
SET_STATE = "set-state"

# node_config keys (``flower-supernode --node-config``); the simulation engine sets the first two itself
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DATA_ROOT = "data-root"


def config_text(config: Config) -> str:
    """The resolved config as YAML: the cache key of every ClientApp process."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def config_from_text(text: str) -> Config:
    """The Config from :func:`config_text` (already resolved: validated, not resolved again), read as a config
    file is (``fedpcd.config_input``: at most ``MAX_CONFIG_BYTES``, no aliases, bounded nesting and entries,
    no key given twice); a message whose config breaks them: a one-line UserError."""
    what = "the run's config in this message"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise UserError(f"{what} is over {MAX_CONFIG_BYTES // 1024} KiB, the limit of a config file")
    try:
        tree = load_yaml(text)
    except yaml.YAMLError:
        raise UserError(f"{what} is not valid YAML") from None
    except YamlRefused as exc:
        raise UserError(f"{what} {exc}") from None
    if not isinstance(tree, dict):
        raise UserError(f"{what} must hold a mapping of keys, got {type(tree).__name__}")
    return Config.model_validate(tree)


def node_partition(node_config: Any) -> tuple[int, int | None]:
    """(partition id, number of partitions or None) from a node's ``node_config``."""
    if PARTITION_ID not in node_config:
        raise UserError(
            "this SuperNode has no partition id; start it with "
            '--node-config "partition-id=K num-partitions=N" (K = 0..N-1, N = the config\'s clients)'
        )
    n = node_config.get(NUM_PARTITIONS)
    return int(node_config[PARTITION_ID]), (None if n is None else int(n))


# A ClientApp's UserError reaches the server only as text inside Flower's error reason (wrapped differently
# by each runtime: Ray adds its own exception types and a traceback), so its message is tagged.
_TAG_OPEN, _TAG_CLOSE = "[fedpcd-user-error] ", " [/fedpcd-user-error]"
_USER_ERROR = re.compile(re.escape(_TAG_OPEN) + "(.*?)" + re.escape(_TAG_CLOSE), re.S)


def tag_user_error(exc: UserError) -> UserError:
    """The same UserError with its message tagged, so the server can recognise it in an error reply."""
    text = str(exc)
    return exc if text.startswith(_TAG_OPEN) else UserError(_TAG_OPEN + text + _TAG_CLOSE)


def raise_for_error(msg: Any, what: str) -> None:
    """Turn a Flower error reply into an exception (a one-line UserError when the ClientApp raised one)."""
    if not msg.has_error():
        return
    reason = msg.error.reason or "no reason given"
    found = _USER_ERROR.search(reason)
    if found:
        raise UserError(f"{what}: {found.group(1)}")
    raise RuntimeError(f"{what} failed (Flower error code {msg.error.code}): {reason}")
