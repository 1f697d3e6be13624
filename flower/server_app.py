"""afl's Flower ``ServerApp`` (``serverapp = "afl.flower.server_app:app"``, docs/flower.md).

It opens the coordinator's kit and state (``server.toml``: federation, provisioned sites and
their identity keys, the [round] settings, the signing key, the state folder) and serves the
active afl run — or a new one with server.toml's [round] when none is active — to the Flower
nodes through :class:`afl.flower.relay.Relay`; it returns when that run ended.

Run config (``[tool.flwr.app.config]`` of flower/app/pyproject.toml, or ``flwr run -c``):

    afl-server-config   path of the coordinator's server.toml (on the machine of the ServerApp)
    afl-max-wait-s      abort the run when it has not ended after this many seconds (3600)
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from afl.flower.envelope import MESSAGE_TYPE, RECORD, EnvelopeError, ToSite, from_site
from afl.flower.relay import RelayOutcome, Reply, serve_federation
from afl.server.errors import ConfigError, RefusedError, StateError

__all__ = ["GridTransport", "app", "make_app", "serve"]

log = logging.getLogger("flwr")


class GridTransport:
    """:class:`afl.flower.relay.Transport` over a Flower Grid."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def node_ids(self) -> list[int]:
        return list(self.grid.get_node_ids())

    def push(self, messages: list[tuple[int, ToSite]]) -> list[str]:
        out = [
            Message(
                RecordDict({RECORD: ConfigRecord(dict(m.record()))}),
                dst_node_id=node,
                message_type=MESSAGE_TYPE,
            )
            for node, m in messages
        ]
        ids = list(self.grid.push_messages(out))
        if len(ids) != len(out):
            raise RuntimeError(f"the Grid took {len(ids)} of {len(out)} messages")
        return ids

    def pull(self, message_ids: Collection[str]) -> list[Reply]:
        replies = []
        for message in self.grid.pull_messages(list(message_ids)):
            meta = message.metadata
            if message.has_error():
                error = f"the ClientApp failed: {message.error.reason}"
                replies.append(Reply(meta.reply_to_message_id, meta.src_node_id, None, error))
                continue
            try:
                record = message.content.config_records[RECORD]
                content = from_site(dict(record))
            except (KeyError, EnvelopeError) as exc:
                replies.append(Reply(meta.reply_to_message_id, meta.src_node_id, None, str(exc)))
                continue
            replies.append(Reply(meta.reply_to_message_id, meta.src_node_id, content))
        return replies


def serve(grid: Grid, run_config: Mapping[str, object]) -> RelayOutcome:
    """Serve one afl run over ``grid`` with the coordinator of ``afl-server-config``."""
    path = str(run_config.get("afl-server-config") or "")
    if not path:
        raise ConfigError("set the run config afl-server-config to the coordinator's server.toml")
    max_wait = run_config.get("afl-max-wait-s", 3600.0)
    if not isinstance(max_wait, int | float) or max_wait <= 0:
        raise ConfigError(
            f"the run config afl-max-wait-s must be a positive number, not {max_wait!r}"
        )
    return serve_federation(path, GridTransport(grid), max_wait_s=float(max_wait))


def make_app(defaults: Mapping[str, object] | None = None) -> ServerApp:
    """The ServerApp; ``defaults`` fill in run config keys the run does not set (for an app
    started from Python, e.g. the simulation engine's ``run_simulation``)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            outcome = serve(grid, {**(defaults or {}), **context.run_config})
        except (ConfigError, RefusedError, StateError) as exc:
            log.error("afl: %s", exc)
            raise RuntimeError(f"afl: {exc}") from None
        log.info(
            "afl run %s %s%s: %d sites, %d messages, %.2f s",
            outcome.run_id,
            outcome.state,
            f" ({outcome.reason})" if outcome.reason else "",
            len(outcome.sites),
            outcome.messages,
            outcome.seconds,
        )

    return server


app = make_app()
