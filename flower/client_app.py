"""afl's Flower ``ClientApp`` (``clientapp = "afl.flower.client_app:app"``, docs/flower.md).

Each ``query.afl`` message runs one step of the site (:class:`afl.flower.site.FlowerSite`) with
the site's own kit: ``client.toml`` (identity key, the coordinator's key, peers' keys, feature
cache, state folder and [policy]) found by

    node config ``afl-client-config``   the path on the SuperNode's machine (deployment:
                                        ``flower-supernode --node-config "afl-client-config='...'"``)
    environment ``AFL_CLIENT_CONFIG``   the same, set by the site where it starts the SuperNode
                                        (an NVIDIA FLARE client starts it: docs/flower.md §5)
    run config ``afl-client-configs``   comma-separated paths, indexed by the node's
                                        ``partition-id`` (the simulation engine's virtual nodes)

in that order: the site's own settings first; the run config (chosen by whoever submits the run)
is for the simulation engine, where every node runs on the submitter's machine.

The site (kit, cache, statistics) is opened once per process; what it keeps between messages is
the sealed session in the node's Context (:mod:`afl.flower.session`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from afl.client.config import ConfigError, load_client_config
from afl.flower.envelope import RECORD
from afl.flower.site import FlowerDecryptor, FlowerSite, handle, open_site

__all__ = ["ENV_CONFIG", "app", "make_app", "site_config_path"]

SESSION = "afl-session"
ENV_CONFIG = "AFL_CLIENT_CONFIG"
_SITES: dict[str, FlowerSite | FlowerDecryptor] = {}


def site_config_path(
    node_config: Mapping[str, object],
    run_config: Mapping[str, object],
    environ: Mapping[str, str] = os.environ,
) -> str:
    """Where this node's client.toml is (module docstring); :class:`ConfigError` if nowhere."""
    own = node_config.get("afl-client-config") or environ.get(ENV_CONFIG)
    if own:
        return str(own)
    paths = [p.strip() for p in str(run_config.get("afl-client-configs") or "").split(",")]
    paths = [p for p in paths if p]
    partition = node_config.get("partition-id")
    if isinstance(partition, int) and 0 <= partition < len(paths):
        return paths[partition]
    raise ConfigError(
        "this node has no site kit: give the SuperNode --node-config "
        f"\"afl-client-config='/path/client.toml'\" or the environment {ENV_CONFIG}, or "
        "(simulation) the run config "
        f"afl-client-configs one path per node (partition {partition!r}, {len(paths)} paths)"
    )


def _site(context: Context, run_config: dict[str, object]) -> FlowerSite | FlowerDecryptor:
    path = site_config_path(dict(context.node_config), run_config)
    site = _SITES.get(path)
    if site is None:
        site = _SITES[path] = open_site(load_client_config(path))
    return site


def make_app(defaults: Mapping[str, object] | None = None) -> ClientApp:
    """The ClientApp; ``defaults`` fill in run config keys the run does not set (for an app
    started from Python, e.g. the simulation engine's ``run_simulation``)."""
    client = ClientApp()

    @client.query("afl")
    def afl_step(message: Message, context: Context) -> Message:
        site = _site(context, {**(defaults or {}), **context.run_config})
        kept = context.state.config_records.get(SESSION)
        sealed = kept["blob"] if kept is not None else None
        if sealed is not None and not isinstance(sealed, bytes):
            raise TypeError("the node's afl session is not bytes")
        record = dict(message.content.config_records[RECORD])
        reply, sealed = handle(site, record, sealed)
        context.state[SESSION] = ConfigRecord({"blob": sealed})
        return Message(RecordDict({RECORD: ConfigRecord(dict(reply))}), reply_to=message)

    return client


app = make_app()
