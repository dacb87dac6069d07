"""The Hydra training app: ``lightning-dist-train`` (or ``python -m lightning_dist.run.train``).

One job = compose the config, check the layout, start the ranks ourselves (so Hydra multiruns work: see
:mod:`lightning_dist.run.launch`), run Lightning's ``Trainer.fit`` on every rank, and print where things went.

This process (the launcher) checks the config and starts the ranks without importing what the ranks run (torch,
Lightning, the model): the ranks fork from a server that has those loaded (``launch``), and what only a rank or a
restart needs is imported by the function that needs it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lightning_dist.checkpoint.folder import complete_checkpoints, pointed
from lightning_dist.config.cluster_rules import should_submit
from lightning_dist.config.keys import group_options, hydra_error_line, search_dirs, unknown_option_line
from lightning_dist.config.loggers import is_wandb
from lightning_dist.config.loggers import moved_key as moved_logger_key
from lightning_dist.config.resumed import with_run_overrides
from lightning_dist.config.schema import CONF_DIR, DataConfig, TrainConfig, register_configs, to_train_config
from lightning_dist.config.trainer_args import MOVED
from lightning_dist.config.validate import ValidRun, validate
from lightning_dist.environment import is_global_zero
from lightning_dist.errors import PREEMPTED_EXIT_CODE, DivergedError, first_line
from lightning_dist.run import slurm
from lightning_dist.run.cluster import preflight
from lightning_dist.run.console import LOG_FILE, log_to, say
from lightning_dist.run.help import answer_help
from lightning_dist.run.launch import RankFailedError, launch, launched_externally
from lightning_dist.run.lock import hold_run_folder
from lightning_dist.run.replica_groups import launch_replica_groups
from lightning_dist.run.result import RunResult
from lightning_dist.telemetry.report import render, write_summary

log = logging.getLogger("lightning_dist")

register_configs()


def main() -> None:
    """Console-script entry point; errors are one line on stderr and a non-zero exit.

    Hydra's own errors (a mistyped key or option, a run folder it cannot write) are raised to here
    (``HYDRA_FULL_ERROR=1`` while it runs) and said in one line of ours; ``HYDRA_FULL_ERROR=1`` set by the user
    keeps Hydra's traceback.
    """
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        _help(sys.argv[1:])
    for arg in sys.argv[1:]:  # before Hydra, whose message ("not in struct mode") would not say where they went
        key = arg.lstrip("+~").split("=", 1)[0]
        if key.startswith("trainer.") and key.removeprefix("trainer.") in MOVED:
            raise SystemExit(
                f"{key} moved out of trainer. (it is not a Trainer argument): use "
                f"{MOVED[key.removeprefix('trainer.')]}={arg.split('=', 1)[-1]}"
            )
        moved = moved_logger_key(key) if key.startswith("logger.") else None
        if moved:
            raise SystemExit(f"{moved}={arg.split('=', 1)[-1]}" if "=" in arg else moved)
    _compose_with_the_runs_overrides()
    _check_recipe(sys.argv[1:])
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except Exception as err:
        if full_error == "1":
            raise
        print(f"error: {launch_error(err)}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error


def _check_recipe(args: list[str]) -> None:
    """Hydra runs the default job when a ``recipe`` (an optional group) is not found: the name is checked against the
    recipes of every folder on the search path (ours, ``--config-dir``, ``hydra.searchpath``) before Hydra starts."""
    dirs = search_dirs(args)
    if dirs is None:  # a search path entry not found here: Hydra will say what it can
        return
    for arg in args:
        group, _, value = arg.lstrip("+").partition("=")
        if group != "recipe" or not value or value == "null" or "(" in value:  # sweep functions: Hydra's own check
            continue
        options = sorted({name for folder in (CONF_DIR, *dirs) for name in group_options(folder, "recipe") or []})
        for name in value.split(","):  # a sweep over recipes: each of them
            if name not in options:
                print(f"error: {unknown_option_line(group, name, options)}", file=sys.stderr, flush=True)
                sys.exit(1)


def _compose_with_the_runs_overrides() -> None:
    """``resume=<run>``: the run's own overrides before the command line's (:mod:`lightning_dist.config.resumed`),
    in ``sys.argv`` where Hydra reads them, said in one line."""
    given = sys.argv[1:]
    args = with_run_overrides(given)
    if args != given:
        sys.argv[1:] = args
        if is_global_zero():
            theirs = [arg for arg in args if arg not in given]
            print(f"resume: the run's own overrides first: {' '.join(theirs)}", file=sys.stderr, flush=True)


def _help(args: list[str]) -> None:
    """``--help [GROUP | GROUP.FIELD]`` with any overrides: ours (:func:`~lightning_dist.run.help.answer_help`)."""
    answer_help(args)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> RunResult | float:
    """One job. In a sweep (``-m``) it returns the value of ``objective`` a sweeper optimizes, and a point that fails
    (a bad value, a diverging run, a dead rank) is the sweeper's worst value after its one-line error (NaN, or +-inf
    for a sweeper that states its direction): the sweep goes on."""
    slurm.adopt_submitit_environment()  # a task of a Hydra submitit-launcher job: one rank
    hydra_cfg = HydraConfig.get()
    output_dir = cfg.output_dir or hydra_cfg.runtime.output_dir
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        train_cfg = to_train_config(cfg)
        train_cfg.output_dir = output_dir
        for node in train_cfg.logger.values():  # every point of one sweep in one W&B group
            if sweep and is_wandb(node) and node.get("group") is None:
                node["group"] = sweep_group(hydra_cfg.sweep.dir)
        result = run(train_cfg)
    except (ValueError, OSError, RankFailedError) as err:  # OSError: a folder that cannot be written, a full disk
        if not sweep:
            _fail(err, Path(output_dir))
        _report_failure(err, Path(output_dir))
        return failed_value(hydra_cfg.sweeper)
    if result.preempted:
        saved = f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint (checkpointing off)"
        say(
            f"preempted: {result.preempted} received; stopped after step {result.steps}, {saved}; continue "
            f"with: lightning-dist-train resume={result.output_dir}",
            err=True,
        )
        sys.exit(PREEMPTED_EXIT_CODE)
    if not sweep:
        return result
    value = objective_value(result, cfg.objective)
    return value if math.isfinite(value) else failed_value(hydra_cfg.sweeper)


def failed_value(sweeper: Any) -> float:
    """What a failed point returns: the worst value for a sweeper that states its direction (Optuna's ``direction``,
    Nevergrad's ``optim.maximize``), which ends the whole sweep on NaN; NaN for the others (the basic sweeper)."""
    direction = sweeper.get("direction") if hasattr(sweeper, "get") else None
    if isinstance(direction, (list, tuple)) or OmegaConf.is_list(direction):
        direction = direction[0] if len(direction) == 1 else None
    maximize = sweeper.get("optim", {}).get("maximize") if hasattr(sweeper, "get") else None
    if direction is not None:
        maximize = str(direction).lower().endswith("maximize")
    if maximize is None:
        return float("nan")
    return -math.inf if maximize else math.inf


def objective_value(result: RunResult, name: str) -> float:
    """The last logged value of metric ``name`` (``val/loss``, ``train/loss`` or any key of the history); NaN when the
    run logged none (a sweeper counts the point as failed)."""
    if name == "val/loss" and result.val_loss is not None:
        return float(result.val_loss)
    if name == "train/loss" and result.train_loss is not None:
        return float(result.train_loss)
    values = [record[name] for record in result.history if record.get(name) is not None]
    if values:
        return float(values[-1])
    print(f"warning: objective={name!r} was never logged in {result.output_dir}; returning NaN", file=sys.stderr)
    return float("nan")


def sweep_group(sweep_dir: str) -> str:
    """The W&B group of a sweep: its folder, e.g. ``multirun/2026-11-24/20-30-00`` -> ``sweep-2026-11-24-20-30-00``."""
    parts = [part for part in Path(sweep_dir).parts if part not in ("multirun", ".", "..", "/")]
    return "sweep-" + "-".join(parts[-2:]) if parts else "sweep"


def run(cfg: TrainConfig) -> RunResult:
    """Check ``cfg``, run it on ``cluster.devices`` local ranks (or in this rank under torchrun/SLURM), report."""
    valid = validate(cfg)
    cfg, dims = valid.cfg, valid.dims
    out_dir = Path(cfg.output_dir)
    _check_writable(out_dir)
    if (out_dir / "checkpoints").exists():  # found now, not at the first save after hours of training
        _check_writable(out_dir / "checkpoints", "its checkpoints folder ")
    if is_global_zero():  # the launcher (or rank 0 under torchrun / srun): its lines go to <run>/train.log too
        log_to(out_dir)
    if should_submit(cfg.cluster):  # on the login node
        result = slurm.submit(cfg, valid.layout, run)
        if result.steps is not None:  # submitit's local executor ran it here
            _print_summary(result, cfg)
        return result
    # One job per run folder: held by the launcher (ours) or rank 0 (torchrun / srun), released however this ends.
    with hold_run_folder(out_dir) if is_global_zero() else nullcontext():
        start = time.perf_counter()
        groups_apart = cfg.parallelism.replicas.fault_tolerant and not launched_externally()
        if launched_externally():  # torchrun / SLURM restart the job themselves (torchrun --max-restarts, requeue)
            preflight(cfg, dims)
            result = _fit(valid)
            if result.preempted and cfg.cluster.slurm.requeue:
                slurm.requeue()
        elif groups_apart:  # each replica group a job of its own, restarted alone, reported in its own folder
            result = launch_replica_groups(valid, _fit, report=_write_report)
        else:
            result = _launch_with_restarts(valid)
        if not groups_apart:
            result.wall_time_s = time.perf_counter() - start
            if is_global_zero():  # one writer per job
                _write_report(valid, result)
    _print_summary(result, cfg)
    check_trained(result, cfg.resilience.on_nonfinite)
    return result


def check_trained(result: RunResult, on_nonfinite: str) -> None:
    """Whether a run that went to its end trained a model: not if its last logged ``train/loss`` is NaN or Inf, nor
    if most of its logged steps had a non-finite gradient norm (``resilience.on_nonfinite=skip`` dropped their updates
    and went on). A few dropped updates are said in one line, and the run succeeds.

    Raises:
        DivergedError: One line: what was not finite, on how many steps, where the weights are, and the fix.
    """
    losses = [float(r["train/loss"]) for r in result.history if r.get("train/loss") is not None]
    norms = [
        (int(r.get("step", 0)), float(r["train/grad_norm"]))
        for r in result.history
        if r.get("train/grad_norm") is not None
    ]
    dropped = [step for step, norm in norms if not math.isfinite(norm)]
    bad_losses = sum(1 for loss in losses if not math.isfinite(loss))
    fix = (
        "lower optim.lr or raise optim.warmup_steps, or set resilience.on_nonfinite=stop to end at the first such step."
    )
    where = result.checkpoint or result.output_dir
    if losses and not math.isfinite(losses[-1]):
        raise DivergedError(
            f"train/loss is {losses[-1]} at the end (step {result.steps}): {bad_losses} of the {len(losses)} logged "
            f"steps had a non-finite loss, {len(dropped)} a non-finite gradient norm (resilience.on_nonfinite="
            f"{on_nonfinite}: their updates dropped), so the weights in {where} are not a trained model's; {fix}"
        )
    if dropped and 2 * len(dropped) > len(norms):
        raise DivergedError(
            f"resilience.on_nonfinite={on_nonfinite} dropped the updates of {len(dropped)} of the {len(norms)} logged "
            f"steps (a non-finite gradient norm; the last at step {dropped[-1]}), so the run did not train (train/loss "
            f"{losses[-1] if losses else '-'} at the end) and the weights in {where} are not a trained model's; {fix}"
        )
    if dropped:
        say(
            f"note: resilience.on_nonfinite={on_nonfinite} dropped the updates of {len(dropped)} of the {len(norms)} "
            f"logged steps (a non-finite gradient norm; the last at step {dropped[-1]})",
            err=True,
        )


def _fit(valid: ValidRun) -> RunResult:
    """What each rank runs (a rank :func:`launch` started, or this process under torchrun / ``srun``): Lightning's
    ``Trainer.fit``; rank 0 adds the planner's prediction for the report, where torch and the model are loaded."""
    # deferred: a rank has these loaded (the forkserver's preload); the launcher never imports them (test_layering)
    from lightning_dist.plan.estimate_run import predicted_and_measured
    from lightning_dist.run.fit import fit

    result = fit(valid)
    if is_global_zero():
        result.prediction = predicted_and_measured(valid.cfg, valid.dims, result.to_dict())
    return result


def _write_report(valid: ValidRun, result: RunResult) -> None:
    """``report.json`` always; ``report.html`` and its PNGs unless ``telemetry.report=false``."""
    cfg, dims = valid.cfg, valid.dims
    if cfg.parallelism.replicas.fault_tolerant:  # the report of one replica group: its own ranks
        dims = dims.replica_group()
    result.ranks = _rank_rows(dims, result.rank_layouts)
    result.hardware = cfg.hardware.name
    if isinstance(cfg.data, DataConfig):  # else a user's DataModule: the report counts tokens from the telemetry
        result.tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    write_summary(Path(result.output_dir), result.to_dict())
    if cfg.telemetry.report:
        result.report = str(render(Path(result.output_dir)))


def _rank_rows(dims: Any, layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rank for the report: its coordinates and, from ``strategy.describe()``, what it holds."""
    rows = []
    for rank in range(min(dims.world_size, 256)):
        row: dict[str, Any] = {"rank": rank, **dims.coordinates(rank)}
        if rank < len(layouts):
            held = layouts[rank]
            blocks = held["blocks"]
            row["stages"] = " ".join(f"{s}: {', '.join(b)}" for s, b in zip(held["stages"], blocks)) if blocks else "-"
            row["tensor parallel"] = f"{len(held['tp_styles'])} modules" if held["tp_styles"] else "-"
            row["FSDP2 units"] = len(held["fsdp_units"])
        rows.append(row)
    return rows


def _launch_with_restarts(valid: ValidRun) -> RunResult:
    """Run the ranks; when one dies or hangs, start them again from the newest checkpoint, ``max_restarts`` times.

    A failure that would only repeat (a non-finite step, a bad value found on a rank) is not restarted: the failing
    rank classified its exception's class (:func:`lightning_dist.errors.restart_would_repeat`), and
    ``RankFailedError.will_repeat`` carries that decision here.
    """
    cfg = valid.cfg
    out_dir = Path(cfg.output_dir)
    for attempt in range(cfg.resilience.max_restarts + 1):
        try:
            return launch(_fit, cfg.cluster.devices, valid)[0]
        except RankFailedError as err:
            if attempt == cfg.resilience.max_restarts or err.will_repeat:
                raise
            # deferred: only a restart reads the checkpoint store (torch); a run that succeeds never imports it
            from lightning_dist.checkpoint.resume import newest_whole

            latest = newest_whole(out_dir / "checkpoints", cfg.checkpoint.verify == "checksums")
            valid = replace(valid, cfg=replace(valid.cfg, ckpt_path=str(latest) if latest is not None else None))
            line = (
                f"restart {attempt + 1}/{cfg.resilience.max_restarts}: {err}; from "
                f"{latest if latest is not None else 'the start (no checkpoint yet)'}"
            )
            say(line, err=True)
            with (out_dir / "restarts.log").open("a") as log_file:
                log_file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    raise AssertionError("unreachable")


def _check_writable(folder: Path, what: str = "") -> None:
    """The run folder (and ``what`` in it) must take files (logs, checkpoints) before any rank trains for hours and
    fails to save."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        where = f"output_dir={folder.parent}: {what}{folder}" if what else f"output_dir={folder}"
        raise ValueError(f"{where} is not writable ({err.strerror}); choose another with output_dir=...") from None


def _print_summary(result: RunResult, cfg: TrainConfig) -> None:
    """What ran and where everything went: the run folder, its report, checkpoint, log file and each logger's files."""
    if not is_global_zero():
        return
    floor = result.loss_floor
    result.log_file = str(Path(result.output_dir) / LOG_FILE)
    lines = [
        f"run directory : {result.output_dir}",
        f"layout        : {result.layout}",
        f"steps         : {result.steps} in {result.wall_time_s:.1f} s",
        f"train/loss    : {result.train_loss:.4f}"
        if any("train/loss" in record for record in result.history)
        or result.train_loss is None
        or not math.isnan(result.train_loss)
        else "train/loss    : - (no step trained or logged in this start)",
        f"val/loss      : {result.val_loss:.4f}"
        if result.val_loss is not None
        else f"val/loss      : - ({no_val(cfg, result)})",
    ]
    if floor is not None:
        lines.append(f"loss floor    : {floor:.4f} nats/token (entropy rate of the synthetic corpus)")
    if result.report:
        lines.append(f"report        : {result.report}")
    lines.append(f"checkpoint    : {result.checkpoint or '- (none saved)'}")
    lines.append(f"log file      : {result.log_file}")
    if result.wandb_dir:
        lines.append(f"W&B run       : {result.wandb_dir}  (upload later: wandb sync {result.wandb_dir})")
    if result.csv:
        lines.append(f"metrics.csv   : {result.csv}")
    for name, where in result.logs.items():
        lines.append(f"{name:<14}: {where}")
    say("\n".join(lines))


def no_val(cfg: TrainConfig, result: RunResult) -> str:
    """Why a run has no ``val/loss``, in the summary's words."""
    trainer, data = cfg.trainer, cfg.data
    if trainer.limit_val_batches == 0:
        return "validation off: trainer.limit_val_batches=0"
    if getattr(data, "streaming", False) and getattr(data, "val_path", None) is None:
        return "no validation data: data.streaming=true reads it from data.val_path"
    every = trainer.val_check_interval
    if isinstance(every, int) and result.steps is not None and result.steps < every:
        return f"no validation ran: it runs every trainer.val_check_interval={every} steps; the run took {result.steps}"
    return "no validation ran"


def _fail(err: Exception, out_dir: Path) -> None:
    """One line on stderr (the traceback, when there is one, in ``<run dir>/error.log``), then exit 1."""
    _report_failure(err, out_dir)
    sys.exit(1)


def _report_failure(err: Exception, out_dir: Path) -> None:
    """One line on stderr, whatever else fails; the full traceback, when there is one, goes to
    ``<run dir>/error.log``, else (a full disk, a read-only folder) to a file in the temporary folder."""
    message = f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.strerror else str(err)
    details = getattr(err, "details", "")
    if details:
        message += f"  ({save_traceback(details, out_dir)})"
    if isinstance(err, OSError) or (isinstance(err, RankFailedError) and not err.will_repeat):
        message += left_on_disk(out_dir, said=message)  # a full disk, a dead rank: what the run leaves to go on from
    print(f"error: {message}", file=sys.stderr, flush=True)


def left_on_disk(out_dir: Path, said: str = "") -> str:
    """What a failed run leaves that matters for going on: whether its disk is full, its newest whole checkpoint (what
    ``resume`` continues from) and an incomplete save (never loaded; its space is taken until removed)."""
    full = ""
    try:
        disk = os.statvfs(out_dir)
        if disk.f_bavail * disk.f_frsize < 1 << 20:  # under 1 MiB: a writer's own error may not say so (torch's zip)
            why = "" if "No space left on device" in said else "No space left on device: "
            full = f"; its disk is full ({why}{disk.f_bavail * disk.f_frsize} bytes free)"
    except OSError:
        pass
    checkpoints = out_dir / "checkpoints"
    if not checkpoints.is_dir():
        return full
    published = complete_checkpoints(checkpoints)
    newest = pointed(checkpoints) or (published[-1] if published else None)
    left = [f"{newest} (resume={out_dir} continues from it)" if newest else "no whole checkpoint"]
    partial = sorted(checkpoints.glob(".step-*.partial"))
    if partial:
        left.append(f"an incomplete save {partial[-1]} (never loaded: remove it to free its space)")
    return f"{full}; left on disk: {', '.join(left)}"


def save_traceback(details: str, out_dir: Path | None) -> str:
    """Write a traceback to ``<out_dir>/error.log``, or where it can be written; says where (never raises)."""
    for folder in (out_dir, Path(tempfile.gettempdir())):
        if folder is None:
            continue
        path = folder / "error.log" if folder == out_dir else folder / f"lightning-dist-error-{os.getpid()}.log"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(details)
            return f"traceback: {path}"
        except OSError:
            continue
    return "its traceback could not be written anywhere"


def launch_error(err: Exception) -> str:
    """One line for an error raised outside the job (while Hydra composes the config or prepares the run folder)."""
    explained = hydra_error_line(err)  # a mistyped key or option, named with the closest
    if explained is not None:
        return explained
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):  # Hydra could not make the run folder, or write its files or its log there
        where = f"{cause.filename}: " if cause.filename else ""
        return f"{where}{first_line(cause)}; give a run folder that can be written (output_dir=...)"
    return f"{type(err).__name__}: {first_line(err)}  ({save_traceback(traceback.format_exc(), None)})"


if __name__ == "__main__":
    main()
