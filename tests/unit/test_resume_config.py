"""Training longer is one override: the warmup-stable-decay schedule (transformers' get_wsd_schedule), whose decay a
longer schedule moves, and the rule a resume checks (the rate of every step the run took unchanged), for wsd and for
cosine; and ``resume=<run>`` composing the run's own overrides with the command line's on top."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lightning_dist.config.resumed import with_run_overrides
from lightning_dist.config.start import schedule_change
from lightning_dist.models.optim import OptimConfig, decay_start, lr_factor


@pytest.mark.parametrize(("steps", "fraction", "warmup"), [(100, 0.2, 10), (37, 0.1, 5), (8, 0.5, 1), (10, 1.0, 0)])
def test_wsd_is_transformers_schedule_after_the_warmup(steps: int, fraction: float, warmup: int) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = OptimConfig(schedule="wsd", decay_fraction=fraction, warmup_steps=warmup, min_lr_ratio=0.1)
    ours = lr_factor(cfg, steps)
    decay = steps - decay_start(cfg, steps)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = transformers.get_wsd_schedule(
        optimizer, num_warmup_steps=warmup, num_decay_steps=decay, num_training_steps=steps, min_lr_ratio=0.1
    )
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        theirs.step()
    assert [ours(step) for step in range(warmup, steps)] == pytest.approx(expected[warmup:], abs=1e-12)
    assert [ours(step) for step in range(warmup)] == [(step + 1) / warmup for step in range(warmup)]  # as cosine's


def test_a_longer_wsd_schedule_keeps_every_step_before_its_decay() -> None:
    cfg = OptimConfig(schedule="wsd", decay_fraction=0.2, warmup_steps=10)
    short, long = lr_factor(cfg, 1000), lr_factor(cfg, 2000)
    assert decay_start(cfg, 1000) == 800 and decay_start(cfg, 2000) == 1600
    assert [short(s) for s in range(801)] == [long(s) for s in range(801)]
    assert short(900) < 1.0 == long(900)


def _record(steps: int, **optim: object) -> dict:
    fields = {"schedule": "cosine", "decay_fraction": 0.2, "warmup_steps": 10, "min_lr_ratio": 0.1, **optim}
    return {"seed": 1, "lr_schedule_steps": steps, **{f"optim.{k}": v for k, v in fields.items()}}


def _checkpoints(tmp_path: Path, *steps: int) -> Path:
    folder = tmp_path / "run" / "checkpoints"
    for step in steps:
        (folder / f"step-{step:08d}").mkdir(parents=True)
    return folder


def test_wsd_continues_longer_from_a_checkpoint_before_its_decay_and_names_one_when_past_it(tmp_path: Path) -> None:
    folder = _checkpoints(tmp_path, 400, 800, 1000)
    wsd = {"schedule": "wsd"}
    assert schedule_change(_record(1000, **wsd), _record(2000, **wsd), 800, folder / "step-00000800") is None
    past = schedule_change(_record(1000, **wsd), _record(2000, **wsd), 1000, folder / "step-00001000")
    assert past == (
        "the LR schedule's length (optim.decay_steps, else trainer.max_steps) 1000 -> 2000 (checkpoint step 1000 is "
        "past step 800, where the warmup-stable-decay schedule's decay starts; continue from a checkpoint before it: "
        f"resume={folder / 'step-00000800'})"
    )


def test_cosine_keeps_its_length_and_says_how_to_train_longer(tmp_path: Path) -> None:
    """The rule for cosine: its length sets every step's rate, so a resume keeps it (optim.decay_steps) unless every
    step taken was still in the warmup."""
    folder = _checkpoints(tmp_path, 500)
    change = schedule_change(_record(1000), _record(2000), 500, folder / "step-00000500")
    assert change.endswith(
        "1000 -> 2000 (a cosine schedule's length sets the rate of every step: keep the run's with "
        "optim.decay_steps=1000, at its floor past it; train with optim.schedule=wsd to continue a run longer)"
    )
    assert schedule_change(_record(1000), _record(2000), 5, folder / "step-00000005") is None  # inside the warmup
    switched = schedule_change(_record(1000), _record(1000, schedule="wsd"), 500, folder / "step-00000500")
    assert switched == "optim.schedule cosine -> wsd (the rate of steps already taken would change)"


def _started(run: Path, overrides: list[str], subfolder: str = "") -> None:
    hydra = run / ".hydra" / subfolder
    hydra.mkdir(parents=True, exist_ok=True)
    (hydra / "overrides.yaml").write_text("".join(f"- {override}\n" for override in overrides))
    time.sleep(0.01)


def test_resume_composes_the_runs_own_overrides_with_the_command_lines_on_top(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lora = ["model=hf", "model.pretrained=/models/tiny", "model.lora.rank=4", "optim.schedule=wsd"]
    _started(run, [*lora, "trainer.max_steps=4", f"output_dir={run}"])
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert with_run_overrides([f"resume={run}"]) == [*lora, "trainer.max_steps=4", f"resume={run}"]
    longer = with_run_overrides([f"resume={run}", "trainer.max_steps=8", "model.lora.rank=8"])
    assert longer == [*lora[:2], lora[3], f"resume={run}", "trainer.max_steps=8", "model.lora.rank=8"]
    # A group chosen again drops the run's values inside it; resume=auto reads output_dir's run.
    assert with_run_overrides(["resume=auto", f"output_dir={run}", "model=gpt_tiny"]) == [
        "optim.schedule=wsd", "trainer.max_steps=4", "resume=auto", f"output_dir={run}", "model=gpt_tiny",
    ]  # fmt: skip
    assert with_run_overrides(["trainer.max_steps=8"]) == ["trainer.max_steps=8"]  # no resume: as given


def test_a_start_that_wrote_no_checkpoint_is_not_the_runs_config(tmp_path: Path) -> None:
    """A resume refused before launch (or one that died before its first save) also wrote its overrides: the run's
    config is that of the start that wrote the checkpoint continued."""
    run = tmp_path / "run"
    _started(run, ["model=hf", "trainer.max_steps=4"])
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    time.sleep(0.01)
    _started(run, ["model=hf", "trainer.max_steps=9", f"resume={run}"], "2026-11-28_10-00-00")  # refused
    assert with_run_overrides([f"resume={run}"]) == ["model=hf", "trainer.max_steps=4", f"resume={run}"]
    later = run / "checkpoints" / "step-00000009"
    later.mkdir()
    os.utime(later)  # the second start did save: its overrides are the run's now
    assert with_run_overrides([f"resume={run}"]) == ["model=hf", "trainer.max_steps=9", f"resume={run}"]
    named = with_run_overrides([f"resume={run / 'checkpoints' / 'step-00000004'}"])  # that checkpoint's start
    assert named[:2] == ["model=hf", "trainer.max_steps=4"]
