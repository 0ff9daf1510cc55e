"""The checkpoint format: where things lie, what a manifest says, how a state tree becomes bytes.

Rule: no storage I/O here and no knowledge of tiers, the client or the sidecar. Modules map
values to paths/keys (:mod:`~strata.format.layout`), bytes to models
(:mod:`~strata.format.manifest`), state trees to byte layouts (:mod:`~strata.format.codec`) and
bytes to checksums (:mod:`~strata.format.crc`, which reads a local file it is handed, nothing
else). Everything that reads or writes a tier imports this package, never the other way round.
"""
