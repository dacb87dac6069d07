"""Where a run starts, checked against its config before launch: the checkpoint it continues (found by
:mod:`lightning_dist.checkpoint.resume`) holds this model's tensors and was written by a run with the same data stream
and LR schedule (its run record); the weights it starts from (``init_from``) fit the model."""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.folder import complete_checkpoints
from lightning_dist.checkpoint.full import ModelNames, check_fits, checkpoint_shapes
from lightning_dist.checkpoint.resume import find_start, note
from lightning_dist.checkpoint.store import check_hf_folder, check_loadable, read_rest, run_record_of, step_of
from lightning_dist.checkpoint.weights import is_hf_folder, weight_plan
from lightning_dist.config.build import build_module
from lightning_dist.config.schema import HFModelConfig, TargetConfig, TrainConfig
from lightning_dist.data.config import DataConfig
from lightning_dist.data.contents import data_contents
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.gpt_hf import from_hf_names
from lightning_dist.models.optim import OptimConfig, decay_start, lr_factor
from lightning_dist.models.qlora import NF4_NAMES
from lightning_dist.parallel.options import FROM_PEER


def resolve_start(cfg: TrainConfig) -> tuple[str | None, str | None]:
    """Where the run lives and which checkpoint it continues from (:func:`~lightning_dist.checkpoint.resume.
    find_start`), checked against the run's model; ``init_from`` checked when the run starts fresh. ``cfg`` is not
    changed.

    Raises:
        ValueError: One line naming the value and the fix.
    """
    output_dir, ckpt_path = find_start(cfg.resume, cfg.ckpt_path, cfg.output_dir, cfg.checkpoint.verify == "checksums")
    if ckpt_path == FROM_PEER:  # a live peer's state (torchft): the same model by construction, no file to check
        return output_dir, ckpt_path
    if ckpt_path is not None:
        label = f"ckpt_path={ckpt_path}" if cfg.ckpt_path not in (None, "last") else f"checkpoint {ckpt_path}"
        _check_ckpt_fits(cfg, Path(ckpt_path), label)
    elif cfg.init_from is not None:
        _check_init_from(cfg)
    return output_dir, ckpt_path


# ------------------------------------------------------------------------------ what defines the run it continues
#: Data fields that change how the batches are computed, not which samples they hold (a layout choice).
_NOT_THE_STREAM = ("micro_batch_size", "num_workers", "num_proc", "cache_dir")
#: Where the data is: compared only when a record has no fingerprint of its contents (one written before it had).
_WHERE = ("data.path", "data.val_path")
_LABELS = {
    "lr_schedule_steps": "the LR schedule's length (optim.decay_steps, else trainer.max_steps)",
    "data.contents": "the data's contents (a fingerprint of data.path's files)",
}


def run_record(cfg: TrainConfig, contents: bool = True) -> dict[str, Any]:
    """What defines a run's data stream, learning rate and model's math, noted in each of its checkpoints (a resolved
    config's): the seed, the data's fields (its global batch included) and a fingerprint of its files' contents
    (``contents``: read them; :mod:`~lightning_dist.data.contents`), for the built-in modules the optimizer's fields,
    the LR schedule's length and ``model.lora`` (alpha and dropout change an adapter's output, not its shapes). A run
    that continues one with other values is not the run it continues."""
    record: dict[str, Any] = {"seed": cfg.seed}
    if isinstance(cfg.data, DataConfig):
        record.update({f"data.{k}": v for k, v in asdict(cfg.data).items() if k not in _NOT_THE_STREAM})
        record["data.contents"] = data_contents(cfg.data) if contents else None
    elif isinstance(cfg.data, TargetConfig):
        record.update({"data._target_": cfg.data.target, **{f"data.{k}": v for k, v in cfg.data.kwargs.items()}})
    if isinstance(cfg.model, (GPTConfig, HFModelConfig)):  # a user's module has an optimizer of its own
        record.update({f"optim.{k}": v for k, v in asdict(cfg.optim).items() if k != "decay_steps"})
        steps = cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else f"{cfg.trainer.max_epochs} epochs"
        record["lr_schedule_steps"] = cfg.optim.decay_steps or steps
        lora = cfg.model.lora
        record.update(
            {f"model.lora.{k}": v for k, v in asdict(lora).items()} if lora.enabled else {"model.lora.rank": 0}
        )
    return record


def record_changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each value of the run record ``now`` that differs from the checkpoint's ``recorded`` one, as ``key old -> new``.

    A key the checkpoint's record lacks was not noted when it was written (a newer field): not a change. With both
    fingerprints of the data's contents, those decide and the paths do not (the same files moved are the same data);
    a record without one compares the paths."""
    keys = set(recorded)
    if recorded.get("data.contents") is not None and now.get("data.contents") is not None:
        keys -= set(_WHERE)  # both fingerprints: they decide
    else:
        keys.discard("data.contents")  # one lacks a fingerprint: the paths decide
    return [
        f"{_LABELS.get(key, key)} {recorded.get(key, '-')} -> {now.get(key, '-')}"
        for key in sorted(keys)
        if recorded.get(key) != now.get(key)
    ]


def check_unchanged(cfg: TrainConfig, label: str) -> None:
    """A run continuing the checkpoint ``cfg.ckpt_path`` (``label``: how it was asked for) keeps the seed, data,
    global batch and optimizer that checkpoint's run noted, and the learning rate of every step it took (the LR
    schedule may change after the checkpoint's step only: :func:`schedule_change`); with ``resume_allow_changes`` it
    goes on, saying so.

    Raises:
        ValueError: One line naming each change and the ways on.
    """
    path = Path(cfg.ckpt_path)
    recorded = run_record_of(path)
    if recorded is None:  # written before runs noted it, or by a user's own Trainer
        return
    now = run_record(cfg)
    if "lr_schedule_steps" in recorded:  # noted before optim.schedule existed: the cosine schedule's fields
        recorded = {**_BEFORE_WSD, **recorded}
    changes = record_changes({k: v for k, v in recorded.items() if k not in _SCHEDULE_KEYS}, now)
    step = step_of(path)
    if step is not None and 0 < cfg.trainer.max_steps <= step:
        note(
            f"note: {label}: checkpoint step {step} is this run's end (trainer.max_steps={cfg.trainer.max_steps}): "
            "nothing is left to train; raise trainer.max_steps to train longer"
        )
    schedule = schedule_change(recorded, now, step, path)
    changes += [schedule] if schedule is not None else []
    if not changes:
        return
    if cfg.resume_allow_changes:
        note(f"warning: resume_allow_changes=true: continuing {cfg.ckpt_path} with {', '.join(changes)}")
        return
    raise ValueError(
        f"{label} continues a run with other values: {', '.join(changes)}; it would not continue that run (another "
        "data stream or LR schedule). Resume with the run's own values, or set resume_allow_changes=true to go on "
        "with these."
    )


#: The record's fields that shape the LR schedule (its length, and the factor of each step).
_SCHEDULE_KEYS = (
    "lr_schedule_steps",
    "optim.schedule",
    "optim.decay_fraction",
    "optim.warmup_steps",
    "optim.min_lr_ratio",
)
#: What a record noted before ``optim.schedule`` existed means.
_BEFORE_WSD = {"optim.schedule": "cosine", "optim.decay_fraction": OptimConfig.decay_fraction}


def schedule_change(recorded: dict[str, Any], now: dict[str, Any], step: int | None, path: Path) -> str | None:
    """``None`` when the LR schedule gives every step up to the checkpoint's ``step`` (the one it continues with
    included: its rate was set when the checkpoint was saved) the rate the run's own schedule gave it, e.g. training
    longer under ``optim.schedule=wsd`` from a checkpoint before the decay; else the change in words and the way on."""
    if all(recorded.get(key) == now.get(key) for key in _SCHEDULE_KEYS):
        return None
    before, after = _rates(recorded, step), _rates(now, step)
    if before is not None and before == after:
        return None
    changed = [
        f"{_LABELS.get(key, key)} {recorded.get(key, '-')} -> {now.get(key, '-')}"
        for key in _SCHEDULE_KEYS
        if recorded.get(key) != now.get(key)
    ]
    return f"{', '.join(changed)} ({_way_on(recorded, now, step, path)})"


def _way_on(recorded: dict[str, Any], now: dict[str, Any], step: int | None, path: Path) -> str:
    """How to train longer than the run's schedule without changing the rate of a step it took (the rule: under wsd,
    from a checkpoint before the decay; under cosine, whose length sets every step's rate, not at all)."""
    old, new = recorded.get("lr_schedule_steps"), now.get("lr_schedule_steps")
    only_length = all(recorded.get(key) == now.get(key) for key in _SCHEDULE_KEYS[1:])
    if not (only_length and isinstance(old, int) and isinstance(new, int)):
        return "the rate of steps already taken would change"
    if now.get("optim.schedule") == "wsd":
        start = min(decay_start(_optim_of(recorded), old), decay_start(_optim_of(now), new))
        earlier = [c for c in complete_checkpoints(path.parent) if _step_in_name(c) <= start]
        where = f"resume={earlier[-1]}" if earlier else "none of the run's is that early"
        return (
            f"checkpoint step {step} is past step {start}, where the warmup-stable-decay schedule's decay starts; "
            f"continue from a checkpoint before it: {where}"
        )
    return (
        f"a cosine schedule's length sets the rate of every step: keep the run's with optim.decay_steps={old}, at "
        "its floor past it; train with optim.schedule=wsd to continue a run longer"
    )


def _rates(record: dict[str, Any], step: int | None) -> list[float] | None:
    """The LR factor of steps 0 to ``step`` under the schedule ``record`` notes; ``None``: unknown."""
    length = record.get("lr_schedule_steps")
    if step is None or not isinstance(length, int):
        return None
    factor = lr_factor(_optim_of(record), length)
    return [factor(s) for s in range(step + 1)]


def _optim_of(record: dict[str, Any]) -> OptimConfig:
    """The ``OptimConfig`` a run record notes (its ``optim.*`` fields)."""
    names = {f.name for f in fields(OptimConfig)}
    return OptimConfig(**{k[len("optim.") :]: v for k, v in record.items() if k[len("optim.") :] in names})


def _step_in_name(path: Path) -> float:
    """The step of a published checkpoint ``step-<N>`` (infinite for another name)."""
    digits = path.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else math.inf


def _check_init_from(cfg: TrainConfig) -> None:
    """``init_from`` names weights this model can start from: a HuggingFace folder or a whole checkpoint folder."""
    path = Path(cfg.init_from)
    if is_hf_folder(path):
        check_hf_folder(path, cfg.checkpoint.verify == "checksums")  # an export or a checkpoint's hf/: whole
        if isinstance(cfg.model, GPTConfig):
            from_hf_names(cfg.model)  # raises for the layouts that cannot be read slice by slice
        elif not isinstance(cfg.model, HFModelConfig):
            raise ValueError(
                f"init_from={path} is a HuggingFace folder, which only the built-in GPT and model=hf read; start from "
                "a lightning-dist checkpoint folder, or load the weights in your module's configure_model."
            )
    elif path.is_dir() and (path / ".metadata").exists():
        check_loadable(path, cfg.checkpoint.verify == "checksums")
    else:
        raise ValueError(
            f"init_from={path} is neither a HuggingFace folder (config.json + *.safetensors) nor a sharded checkpoint "
            "folder (.metadata); export a checkpoint with lightning-dist-export, or give its checkpoints/step-N folder."
        )
    if isinstance(cfg.model, (GPTConfig, HFModelConfig)):  # names and shapes, on the meta device: nothing allocated
        module = _on_meta(cfg)
        weight_plan(path, module, module.state_dict())


def _check_ckpt_fits(cfg: TrainConfig, path: Path, label: str) -> None:
    """The checkpoint a run continues from (a single file or a sharded folder) holds exactly this model's tensors, of
    its shapes: checked for the built-in GPT and model=hf on the meta device (nothing allocated); a user's own module
    is checked by the strategy as it loads."""
    if isinstance(cfg.model, (GPTConfig, HFModelConfig)):
        fields = "model.n_layers, model.d_model, ..." if isinstance(cfg.model, GPTConfig) else "model.config"
        fix = f"set the model config the checkpoint was trained with ({fields})"
        check_fits(label, checkpoint_shapes(path), ModelNames.of(_on_meta(cfg)).shapes, fix)
        quantize = cfg.model.lora.quantize if cfg.model.lora.enabled else None
        if quantize is None and path.is_dir() and read_rest(path, False).get(NF4_NAMES):
            raise ValueError(
                f"{label} holds a QLoRA run's 4-bit base (model.lora.quantize=nf4), which a run without it cannot "
                f"continue; set model.lora.quantize=nf4, or start a new run from its weights: init_from={path}."
            )


def _on_meta(cfg: TrainConfig) -> torch.nn.Module:
    """The run's LightningModule with its model built on the meta device."""
    with torch.device("meta"):
        module = build_module(cfg)
        module.configure_model()
    return module
