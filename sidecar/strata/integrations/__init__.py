"""Adapters for the trainers people use; each imports its trainer library only when used.

- :mod:`strata.integrations.lightning`: :class:`~strata.integrations.lightning.StrataCheckpointIO`,
  a Lightning ``CheckpointIO`` plugin (``Trainer(plugins=[StrataCheckpointIO(...)])``).
- :mod:`strata.integrations.hf`: :class:`~strata.integrations.hf.StrataCallback`, a Hugging Face
  ``TrainerCallback``, and :func:`~strata.integrations.hf.resume_checkpoint`, which writes the
  newest Strata step as a Trainer checkpoint directory for ``trainer.train(resume_from_checkpoint=...)``.
- torchtitan: :mod:`strata.dcp` accepts torchtitan's path-style checkpoint ids
  (``".../step-100"``); :mod:`strata.integrations.torchtitan` has the two calls a
  ``CheckpointManager`` makes (``dcp_save`` / ``dcp_load``) over Strata's tiers.

Every adapter keeps the trainer's own resume semantics and adds Strata's: saves block only for
the copy into a RAM slot, the sidecar promotes them (RAM -> PVC -> GCS), and a restore reads the
nearest tier that holds a verified copy.
"""
