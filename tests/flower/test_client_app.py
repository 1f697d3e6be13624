"""Where afl's ClientApp finds its site's kit (afl.flower.client_app.site_config_path): the site's
own settings (node config, then its environment) come before the run config, which only the
simulation engine's virtual nodes use; a node with none gets a one-line error naming the ways."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="the Flower extra is not installed (make venv installs it)")

from afl.client.config import ConfigError
from afl.flower.client_app import ENV_CONFIG, site_config_path

RUN = {"afl-client-configs": "/sim/a.toml, /sim/b.toml"}


def test_the_node_config_comes_first() -> None:
    node = {"afl-client-config": "/site/client.toml", "partition-id": 1}
    env = {ENV_CONFIG: "/env/client.toml"}
    assert site_config_path(node, RUN, env) == "/site/client.toml"


def test_the_site_environment_comes_before_the_run_config() -> None:
    assert site_config_path({"partition-id": 1}, RUN, {ENV_CONFIG: "/env/c.toml"}) == "/env/c.toml"


def test_a_virtual_node_takes_its_partition_s_path() -> None:
    assert site_config_path({"partition-id": 1}, RUN, {}) == "/sim/b.toml"


@pytest.mark.parametrize("node", [{}, {"partition-id": 2}, {"partition-id": -1}])
def test_a_node_without_a_kit_is_told_how_to_give_one(node: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=f"afl-client-config.*{ENV_CONFIG}"):
        site_config_path(node, RUN, {})
