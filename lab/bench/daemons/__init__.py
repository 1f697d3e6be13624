"""Benchmarks that run real daemons over loopback mTLS: one round per mode (:mod:`.e2e`, also the
command start-up bench), many sites with the full or sparse masking graph (:mod:`.scaling_e2e`),
and the federation log's cost (:mod:`.logcost`, with its lab-only baseline wrapper
:mod:`.unlogged`)."""
