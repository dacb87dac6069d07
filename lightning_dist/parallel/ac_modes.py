"""The activation-checkpointing modes by name: plain Python, so the options
(:class:`~lightning_dist.parallel.options.ActivationCheckpointOptions`) check them without torch; the torch code that
checkpoints blocks is :mod:`.activation_checkpoint`."""

from __future__ import annotations

#: ``activation_checkpointing.mode`` values (what each does: :mod:`.activation_checkpoint`).
MODES = ("none", "full", "selective")
#: ``activation_checkpointing.selective`` values that choose an op-level policy (the other values are a block
#: interval ``"<n>"``).
OP_POLICY_NAMES = ("op", "op_half")
