"""The config's context (the SHA-256 of the signed plan, which binds the logged roster's digest;
docs/protocol.md §4.2, M-223) is bound into every advert and consistency signature: a party
holding the same round under another context (another plan, another roster) refuses them,
although round id, salt, cohort, threshold and releases agree."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from afl.crypto.errors import (
    ProtocolError,
    SecAggConfigError,
    UnmaskRefusedError,
)
from afl.crypto.identity.signatures import sign_fields, signed_message, verify_fields
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.messages import (
    ADVERTISE_CONTEXT,
    CONSISTENCY_CONTEXT,
    KeyDirectory,
    Stage,
    consistency_fields,
    consistency_messages,
    signed_advert_fields,
)
from afl.crypto.secagg.server import SecAggServer
from tests.crypto.secagg_helpers import Federation, make_federation, run_to_survivors

PLAN = hashlib.sha256(b"the plan this site accepted").digest()
OTHER = hashlib.sha256(b"a plan binding another roster").digest()


def _federation() -> Federation:
    fed = make_federation(n=4, threshold=3)
    return replace(fed, config=replace(fed.config, context=PLAN))


def _clients(fed: Federation, contexts: dict[str, bytes]) -> dict[str, SecAggClient]:
    """Honest clients of ``fed``, each holding the round under its context (default PLAN)."""
    identities = {s: k.public_key() for s, k in fed.keys.items()}
    return {
        s: SecAggClient(
            site_id=s,
            identity_key=fed.keys[s],
            config=replace(fed.config, context=contexts.get(s, PLAN)),
            identities=identities,
            inputs=fed.inputs[s],
        )
        for s in fed.config.cohort
    }


def test_the_context_changes_the_digest_and_must_be_bytes() -> None:
    fed = _federation()
    assert replace(fed.config, context=OTHER).digest() != fed.config.digest()
    assert replace(fed.config, context=PLAN).digest() == fed.config.digest()
    with pytest.raises(SecAggConfigError, match="context must be bytes"):
        replace(fed.config, context="plan")  # type: ignore[arg-type]


def test_an_advert_made_under_another_context_does_not_verify() -> None:
    fed = _federation()
    victim = fed.config.cohort[0]
    clients = _clients(fed, {victim: OTHER})
    adverts = {s: c.advertise_keys() for s, c in clients.items()}
    key = fed.keys[victim].public_key()
    verify_fields(  # the advert is the victim's own, valid under the context it holds
        key,
        adverts[victim].signature,
        context=ADVERTISE_CONTEXT,
        fields=signed_advert_fields(replace(fed.config, context=OTHER), adverts[victim]),
    )
    # The honest coordinator (under PLAN) refuses it ...
    server = SecAggServer(
        config=fed.config, identities={s: k.public_key() for s, k in fed.keys.items()}
    )
    with pytest.raises(ProtocolError, match=f"{victim}.*does not verify"):
        server.receive(adverts[victim], sender=victim)
    # ... and so does an honest site it is relayed to by a coordinator that does not check.
    directory = KeyDirectory(fed.config.round_id, tuple(adverts.values()))
    honest = clients[fed.config.cohort[1]]
    with pytest.raises(ProtocolError, match=f"advert of '{victim}' does not verify"):
        honest.share_keys(directory)
    assert honest.stage == Stage.ABORTED  # it sent nothing: no share of its secrets


def test_a_consistency_signature_made_under_another_context_does_not_verify() -> None:
    """The victim signs the same survivor list U3 under the other context: the coordinator
    refuses the signature, and a site shown it among the t signatures refuses to unmask."""
    fed = _federation()
    victim, honest = fed.config.cohort[0], fed.config.cohort[1]
    clients = _clients(fed, {})
    server = SecAggServer(
        config=fed.config, identities={s: k.public_key() for s, k in fed.keys.items()}
    )
    u3 = run_to_survivors(server, clients)
    signed = {s: c.consistency_check(u3) for s, c in clients.items()}
    other = replace(fed.config, context=OTHER)
    forged = replace(
        signed[victim],
        signature=sign_fields(
            fed.keys[victim],
            context=CONSISTENCY_CONTEXT,
            fields=consistency_fields(other, site_id=victim, survivors=u3.survivors),
        ),
    )
    with pytest.raises(ProtocolError, match=f"{victim}.*does not verify"):
        server.receive(forged, sender=victim)
    for s in fed.config.cohort:
        server.receive(signed[s], sender=s)
    request = server.close_consistency()
    assert victim in {item.site_id for item in request.signatures}
    swapped = replace(
        request,
        signatures=tuple(forged if i.site_id == victim else i for i in request.signatures),
    )
    with pytest.raises(UnmaskRefusedError, match=f"consistency signature of '{victim}'"):
        clients[honest].unmask(swapped)
    assert clients[fed.config.cohort[2]].unmask(request).shares  # the honest request is served


def test_the_consistency_messages_encoded_together_are_each_signer_s_message() -> None:
    """A site checks every survivor's consistency signature: the messages it verifies, with
    the config and survivor list encoded once, are exactly what each signer signed."""
    fed = _federation()
    survivors = tuple(reversed(fed.config.cohort))
    signers = [*fed.config.cohort, "not-a-survivor"]
    together = consistency_messages(fed.config, site_ids=signers, survivors=survivors)
    assert together == [
        signed_message(
            context=CONSISTENCY_CONTEXT,
            fields=consistency_fields(fed.config, site_id=s, survivors=survivors),
        )
        for s in signers
    ]
    other = replace(fed.config, context=OTHER)
    assert consistency_messages(other, site_ids=signers, survivors=survivors) != together
