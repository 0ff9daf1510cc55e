"""torch.distributed.checkpoint (DCP) storage backed by Strata's tiers.

::

    import torch.distributed.checkpoint as dcp
    import strata.dcp

    dcp.save(state_dict, storage_writer=strata.dcp.StorageWriter(step=3, job_id="ns.run"))
    dcp.load(state_dict, storage_reader=strata.dcp.StorageReader(step=None, job_id="ns.run"))

:class:`StorageWriter` takes the :class:`strata.Checkpointer`'s settings as keywords (``job_id``,
``ram_dir``, ``pvc_dir``, ``keep``, ``config``, ...; or an existing ``checkpointer=``) and writes
what DCP's planner hands it as one Strata shard per rank: a RAM slot, committed in the RAM tier,
checksummed, promoted by the sidecar like every other step. Each DCP write item becomes one entry
of the shard's state tree ``{"dcp": [{"fqn", "offset", "kind", "size", "chunk_offsets",
"chunk_sizes", "dtype", "data"}, ...]}`` (tensors as tensors, DCP's ``BytesIO`` items as bytes:
nothing is pickled by Strata; DCP itself ``torch.save``\\s non-tensor values into those bytes).
DCP's own planner already writes a replicated tensor once (on rank 0).

``checkpoint_id``: the step (``"3"``) or a path ending in ``step-3`` (torchtitan's ids;
:mod:`strata.dcp.ids`), so ``dcp.save(sd, storage_writer=w, checkpoint_id=f"{folder}/step-3")``
saves step 3.

No metadata file: :class:`StorageReader` rebuilds DCP's ``Metadata`` from the shard manifests of
the step (every chunk of every tensor, its global size and dtype), so any world size can load
it (DCP reshards). ``step=None`` picks the newest step complete in one tier this rank can read
(PVC/GCS, or its own RAM directory in a single-process job). Data is read with
:class:`strata.client.sharded.ShardReader`: this node's RAM, the PVC, GCS, nearest first; each
item's bytes verified against the manifest's chunk CRC32Cs. Another rank's shard that exists
only in that rank's RAM cannot be read: wait for promotion (``Checkpointer.wait`` + the
sidecar) before loading elsewhere.

Errors follow DCP: a failed write raises (DCP turns it into ``CheckpointException`` on every
rank); the previous committed step is untouched.
"""

from __future__ import annotations

from strata.dcp.ids import checkpoint_id_of, step_of_checkpoint_id
from strata.dcp.storage import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter", "checkpoint_id_of", "step_of_checkpoint_id"]
