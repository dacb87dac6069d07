"""The pipeline schedules by name, and the rules a layout's schedule, stages per rank and microbatches must follow.

Plain Python, apart from the torch code that splits a model and runs a schedule (:mod:`.pipeline`, which re-exports
these): :class:`~lightning_dist.parallel.options.PipelineOptions` checks its schedule on construction, and the
launcher of ``lightning-dist-train`` builds one without importing torch.
"""

from __future__ import annotations

#: Schedule name -> stages per rank it runs with (``None`` = 2 or more).
SCHEDULES: dict[str, int | None] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": None,
    "LoopedBFS": None,
    "InterleavedZeroBubble": None,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
#: Schedules that place stages in a "V" (rank r holds stages r and 2p-1-r) instead of round-robin.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def resolve_schedule(name: str, stages_per_rank: int) -> str:
    """The canonical schedule name; raises when it is unknown or does not fit ``stages_per_rank``."""
    by_lower = {key.lower(): key for key in SCHEDULES}
    if name.lower() not in by_lower:
        raise ValueError(f"schedule={name!r} is unknown; use one of {', '.join(SCHEDULES)}.")
    name = by_lower[name.lower()]
    needed = SCHEDULES[name]
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank} must be >= 1.")
    if needed == 1 and stages_per_rank != 1:
        raise ValueError(
            f"schedule={name} runs one stage per rank but stages_per_rank={stages_per_rank}; set stages_per_rank=1 "
            "or use Interleaved1F1B / LoopedBFS / InterleavedZeroBubble for virtual stages."
        )
    if needed is None and stages_per_rank < 2:
        raise ValueError(
            f"schedule={name} is a multi-stage schedule and needs stages_per_rank>=2 (got {stages_per_rank}); "
            "set stages_per_rank=2 or use GPipe / 1F1B."
        )
    if needed == 2 and stages_per_rank != 2:
        raise ValueError(f"schedule={name} needs exactly stages_per_rank=2 (got {stages_per_rank}); set it to 2.")
    return name


def check_microbatches(
    schedule: str, microbatches: int, pp: int, stages_per_rank: int, batch_size: int | None = None
) -> None:
    """Raise when ``microbatches`` does not suit ``schedule`` (torch's own requirements) or the per-rank batch.

    Args:
        schedule: Canonical schedule name (see :func:`resolve_schedule`).
        microbatches: Microbatches per step.
        pp: Pipeline degree.
        stages_per_rank: Virtual stages per rank.
        batch_size: The per-rank batch to split, when known.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1.")
    num_stages = pp * stages_per_rank
    rounds = max(1, microbatches // pp)  # torch's interleaved schedules run microbatches in rounds of pp
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        raise ValueError(
            f"schedule={schedule} needs microbatches <= pp={pp} or a multiple of it (got {microbatches}); "
            f"use microbatches={pp * rounds}."
        )
    if schedule == "DualPipeV" and microbatches < num_stages:
        raise ValueError(
            f"schedule={schedule} needs microbatches >= number of stages {num_stages} (got {microbatches}); "
            f"set microbatches>={num_stages}."
        )
    if schedule == "1F1B" and microbatches < pp:
        raise ValueError(f"schedule=1F1B needs microbatches >= pp={pp} (got {microbatches}); set microbatches>={pp}.")
    if batch_size is not None and batch_size % microbatches:
        raise ValueError(
            f"microbatches={microbatches} does not divide the per-rank batch {batch_size} (the global batch over the "
            f"data-parallel ranks); pick a divisor of {batch_size} or change the global batch size."
        )
