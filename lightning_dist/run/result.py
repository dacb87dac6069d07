"""What a run returns: :class:`RunResult`, from :func:`lightning_dist.run.fit.fit` (each rank), from
:func:`lightning_dist.run.train.run` (the app: rank 0's, with the report's parts) and from
:func:`lightning_dist.run.slurm.submit` (a submission: where the job runs, and its summary when it ran here)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class RunResult:
    """The summary of one run (or of one rank's part of it).

    Fields a kind of result does not have are ``None``: a rank's own :func:`~lightning_dist.run.fit.fit` result has
    no report parts (``wall_time_s``, ``ranks``, ``prediction``, ...), a SLURM submission that did not run here has
    only ``output_dir``, ``layout``, ``job_id`` and ``dry_run``.

    For compatibility with the ``dict`` it replaces, it is also read by key: ``result["steps"]`` (any field;
    ``KeyError`` for another name), ``result.get("val_loss", default)`` (``default`` also for a field that is
    ``None``) and ``"prediction" in result`` (a field that is set, i.e. not ``None``). :meth:`to_dict` is the plain
    form for JSON (``report.json``) and for sending across processes.
    """

    #: The run folder (logs, checkpoints, report).
    output_dir: str
    #: The parallel layout in words, e.g. ``fsdp: pp=1 dp_replicate=1 dp_shard=2 tp=1 (world 2)``.
    layout: str
    #: What the run ran on: processes x device, e.g. ``2 x CPU`` or ``8 x NVIDIA H100 80GB HBM3``.
    devices: str | None = None
    #: Optimizer steps done (``trainer.global_step``); ``None``: the job has not run here (a submission).
    steps: int | None = None
    #: The last logged ``train/loss`` (NaN when none was logged).
    train_loss: float | None = None
    #: The last ``val/loss``; ``None`` without validation.
    val_loss: float | None = None
    #: The synthetic corpus's entropy rate (nats/token), the loss a perfect model reaches; ``None`` for other data.
    loss_floor: float | None = None
    #: One record per optimizer step: ``step``, ``train/loss``, ``train/grad_norm`` and the telemetry metrics.
    history: list[dict[str, Any]] = field(default_factory=list)
    #: What each rank holds (``RankLayout.to_dict()`` of ``strategy.describe(all_ranks=True)``); [] without a mesh.
    rank_layouts: list[dict[str, Any]] = field(default_factory=list)
    #: The newest published checkpoint folder; ``None`` when none was saved.
    checkpoint: str | None = None
    #: Seconds each checkpoint save held the training loop.
    checkpoint_blocked_s: list[float] = field(default_factory=list)
    #: Seconds each checkpoint save took until its files were complete (this rank's).
    checkpoint_written_s: list[float] = field(default_factory=list)
    #: The signal that stopped the run early (``"SIGTERM"``, ``"SIGUSR2"``, ...); ``None`` when it ran to the end.
    preempted: str | None = None
    #: The local W&B run folder (for ``wandb sync``), rank 0 with ``logger=wandb`` only.
    wandb_dir: str | None = None
    #: The ``metrics.csv`` path with ``logger=csv``.
    csv: str | None = None
    #: Where the other loggers write (``logger.<name>`` -> a folder or tracking store), e.g. TensorBoard's events.
    logs: dict[str, str] = field(default_factory=dict)
    #: The run folder's log file: the app's own lines, as printed (``<run>/train.log``).
    log_file: str | None = None
    #: Seconds from launch to the end of the run (the app: :func:`~lightning_dist.run.train.run`).
    wall_time_s: float | None = None
    #: The report's rows, one per rank (at most 256): mesh coordinates and what the rank holds (rank 0 of the app).
    ranks: list[dict[str, Any]] | None = None
    #: ``{quantity: [predicted, measured]}``: the planner's estimate beside the run's measurements (built-in GPT).
    prediction: dict[str, list[Any]] | None = None
    #: The ``hardware`` config the prediction assumed.
    hardware: str | None = None
    #: Tokens per optimizer step over all ranks (``data.global_batch_size x data.seq_len``): the report's tokens axis.
    tokens_per_step: int | None = None
    #: The ``report.html`` path (``telemetry.report=true``).
    report: str | None = None
    #: The SLURM (or submitit local) job id of a submission; ``None`` otherwise, and on a dry run.
    job_id: str | None = None
    #: A SLURM dry run: the job was printed, not submitted.
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (a shallow copy: ``history`` and the other lists are shared)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        """The result of :meth:`to_dict` (keys that are not fields are rejected with ``TypeError``)."""
        return cls(**data)

    # ------------------------------------------------------------------ mapping access, for compatibility
    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value, or ``default`` when it is ``None`` (or ``key`` is no field)."""
        value = getattr(self, key, None) if key in _FIELDS else None
        return default if value is None else value

    def __contains__(self, key: object) -> bool:
        return key in _FIELDS and getattr(self, key) is not None  # type: ignore[arg-type]


_FIELDS = frozenset(f.name for f in fields(RunResult))
