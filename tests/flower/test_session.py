"""The sealed session of a Flower site (afl.flower.session, docs/flower.md §3): a masked round
whose clients are sealed and reopened between every stage (as the Flower app keeps them between
messages) still sums exactly; a blob opens only for its site and federation, untampered; it
holds no long-term key; an authenticated blob that names a class outside afl is refused."""

from __future__ import annotations

import os
import pickle

import pytest

from afl.crypto.aead import seal
from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.server import SecAggServer
from afl.flower import session as sealed_session
from afl.flower.session import SessionError, open_session, seal_session
from tests.crypto.secagg_helpers import assert_sum_matches, exact_sum, make_federation

FED = "fed-test"


def _reopened(client: SecAggClient, fed) -> SecAggClient:
    key = fed.keys[client.site_id]
    blob = seal_session(client, identity=key, federation_id=FED, site_id=client.site_id)
    restored = open_session(blob, identity=key, federation_id=FED, site_id=client.site_id)
    assert isinstance(restored, SecAggClient) and restored is not client
    return restored


def test_a_round_whose_clients_are_sealed_between_stages_sums_exactly() -> None:
    fed = make_federation(n=4, seed=5)
    identities = {s: k.public_key() for s, k in fed.keys.items()}
    server = SecAggServer(config=fed.config, identities=identities)
    clients = {
        s: SecAggClient(
            site_id=s,
            identity_key=fed.keys[s],
            config=fed.config,
            identities=identities,
            inputs=fed.inputs[s],
        )
        for s in fed.config.cohort
    }

    def stage(act) -> None:
        for site in list(clients):
            clients[site] = _reopened(clients[site], fed)
            message = act(site, clients[site])
            if message is not None:
                server.receive(message, sender=site)

    stage(lambda s, c: c.advertise_keys())
    directory = server.close_advertise()
    stage(lambda s, c: c.share_keys(directory))
    routed = server.close_share_keys()
    stage(lambda s, c: c.masked_input(routed[s]))
    request = server.close_masked_input()
    stage(lambda s, c: c.consistency_check(request))
    unmask = server.close_consistency()
    stage(lambda s, c: c.unmask(unmask))
    result = server.close_unmask()
    for name in ("gram", "b"):
        spec = fed.config.release(name)
        assert_sum_matches(
            result.sums[name], exact_sum(fed.inputs, name, spec.members), spec.codec()
        )


def test_a_blob_opens_only_for_its_site_and_federation_untampered() -> None:
    key = generate_identity_key()
    blob = seal_session({"step": "mask"}, identity=key, federation_id=FED, site_id="site-1")
    assert open_session(blob, identity=key, federation_id=FED, site_id="site-1") == {"step": "mask"}
    with pytest.raises(SessionError, match="does not open"):
        open_session(blob, identity=key, federation_id=FED, site_id="site-2")
    with pytest.raises(SessionError, match="does not open"):
        open_session(blob, identity=key, federation_id="other", site_id="site-1")
    with pytest.raises(SessionError, match="does not open"):
        open_session(blob, identity=generate_identity_key(), federation_id=FED, site_id="site-1")
    tampered = bytearray(blob)
    tampered[-20] ^= 1
    with pytest.raises(SessionError, match="does not open"):
        open_session(bytes(tampered), identity=key, federation_id=FED, site_id="site-1")
    with pytest.raises(SessionError, match="too short"):
        open_session(blob[:16], identity=key, federation_id=FED, site_id="site-1")


def _plaintext(blob: bytes, key, site: str) -> bytes:
    """What a blob seals (the module's own key derivation, read back for inspection)."""
    from afl.crypto.aead import open_sealed

    salt = blob[: sealed_session.SALT_BYTES]
    aead_key = sealed_session._key(key, salt=salt, federation_id=FED, site_id=site)
    return open_sealed(
        aead_key,
        blob[sealed_session.SALT_BYTES :],
        associated=sealed_session._associated(FED, site),
    )


def test_the_identity_key_is_not_in_the_sealed_state_and_comes_back_from_the_kit() -> None:
    fed = make_federation(n=3, seed=1)
    site = fed.config.cohort[0]
    key = fed.keys[site]
    client = SecAggClient(
        site_id=site,
        identity_key=key,
        config=fed.config,
        identities={s: k.public_key() for s, k in fed.keys.items()},
        inputs=fed.inputs[site],
    )
    blob = seal_session(client, identity=key, federation_id=FED, site_id=site)
    seed = key.private_bytes_raw()
    assert seed not in _plaintext(blob, key, site)
    restored = open_session(blob, identity=key, federation_id=FED, site_id=site)
    assert restored._identity is key
    other = generate_identity_key()
    with pytest.raises(pickle.PicklingError, match="long-term key"):
        seal_session({"stray": other}, identity=key, federation_id=FED, site_id=site)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_an_authenticated_blob_naming_a_class_outside_afl_is_refused() -> None:
    key = generate_identity_key()
    salt = os.urandom(sealed_session.SALT_BYTES)
    aead_key = sealed_session._key(key, salt=salt, federation_id=FED, site_id="site-1")
    payload = pickle.dumps(_Evil(), protocol=5)
    blob = salt + seal(aead_key, payload, associated=sealed_session._associated(FED, "site-1"))
    with pytest.raises(SessionError, match="not part of a site's session"):
        open_session(blob, identity=key, federation_id=FED, site_id="site-1")
