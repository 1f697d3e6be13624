"""The analytic protocol as a Flower app (docs/flower.md, docs/architecture.md §1).

A Flower ``ServerApp`` runs afl's coordinator (:class:`afl.server.coordinator.Coordinator`: the
round machine, the release plan and its leakage audit, the aggregation modes, the solve and the
signed model) and a Flower ``ClientApp`` runs afl's site (:class:`afl.client.daemon.loop.ClientDaemon`:
the feature cache, the plan check against the site's [policy], the statistics, the masking or
CKKS encryption and the model check); Flower's messages carry afl's protocol messages, the same
protobufs as afl's gRPC service. ``relay`` (coordinator side) and ``site`` (site side) hold the
composition and import no Flower code; ``server_app`` and ``client_app`` are the thin Flower
entry points (``flwr`` is the optional extra ``afl[flower]``).

This package composes :mod:`afl.server` and :mod:`afl.client`; only :mod:`afl.lab` (the
benchmarks) imports it.
"""
