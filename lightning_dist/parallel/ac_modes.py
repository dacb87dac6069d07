"""The activation-checkpointing modes by name, and the check of a mode and its ``ac_selective`` option.

Plain Python, apart from the torch code that checkpoints blocks (:mod:`.activation_checkpoint`, which re-exports
these): :class:`~lightning_dist.parallel.options.ParallelOptions` checks its mode on construction, and the launcher
of ``lightning-dist-train`` builds one without importing torch.
"""

from __future__ import annotations

#: ``activation_checkpointing`` values (what each does: :mod:`.activation_checkpoint`).
MODES = ("none", "full", "selective")
#: ``ac_selective`` values that choose an op-level policy (the other values are a block interval ``"<n>"``).
OP_POLICY_NAMES = ("op", "op_half")


def check_mode(mode: str, selective: str) -> None:
    """Raise a one-line error for an unknown mode or selective option."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is unknown; use one of {', '.join(MODES)}.")
    if mode == "selective" and selective not in OP_POLICY_NAMES and not (selective.isdigit() and int(selective) >= 1):
        raise ValueError(
            f"ac_selective={selective!r}: use 'op' (keep matmul outputs), 'op_half' (keep every other matmul output) "
            "or a block interval n >= 1 (every n-th block fully checkpointed)."
        )
