"""The W&B logger's fields come from the config or W&B's own environment variables, never hard-coded."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import compose_config
from lightning.pytorch.loggers import WandbLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_dist.callbacks.checkpoints import RunCheckpoints, wandb_step_of
from lightning_dist.run.loggers import build_logger, finish_wandb


def _init(overrides: list[str], folder: Path) -> dict:
    cfg = compose_config(["logger=wandb", *overrides])
    return build_logger(cfg.logger["wandb"], folder, cfg)._wandb_init  # what WandbLogger hands wandb.init


def test_wandb_fields_come_from_the_config_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    fields = [
        "logger.wandb.entity=team",
        "logger.wandb.group=g1",
        "logger.wandb.tags=[a,b]",
        "logger.wandb.mode=disabled",
    ]
    init = _init(fields, tmp_path)
    assert (init["project"], init["entity"], init["group"], init["tags"]) == ("from-env", "team", "g1", ["a", "b"])
    assert init["mode"] == "disabled"  # the user's explicit choice
    assert init["name"] == f"gpt-llama-d64-L2 ddp {tmp_path.name}"  # model, layout, run folder
    assert _init(["logger.wandb.project=mine"], tmp_path)["project"] == "mine"  # the config over the environment
    monkeypatch.delenv("WANDB_PROJECT")
    plain = _init([], tmp_path)
    assert plain["project"] == "lightning-dist"
    assert "entity" not in plain and "group" not in plain  # W&B's own defaults (WANDB_ENTITY) apply
    assert "anonymous" not in plain  # wandb warns about the setting even when it is None


# ------------------------------------------------------------------------------------------ W&B resumed runs
def _wandb_env(monkeypatch: pytest.MonkeyPatch, root: Path, mode: str | None) -> None:
    """W&B's variables for one test (Lightning's offline WandbLogger sets ``WANDB_MODE`` itself: restored after)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_RESUME", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if mode is not None:
        monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_DIR", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(root / "no-netrc"))  # no API key: offline by default where no mode is set
    monkeypatch.chdir(root)


def _history(run_folder: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run's ``.wandb`` file (LevelDB-style log, 32 KiB blocks, 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, pos, chunk = next(run_folder.glob("run-*.wandb")).read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        block_end = (pos // 32768 + 1) * 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if block_end - pos < 7 or kind == 0:  # a block's zero padding
            pos = block_end
            continue
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record.FromString(chunk)
            chunk = b""
            if record.HasField("history"):
                items = record.history.item  # "a/b" is stored as nested_key ["a", "b"]
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(16, 2), batch_size=2)


def test_checkpoints_note_the_wandb_step_of_the_rows_before_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import wandb

    _wandb_env(monkeypatch, tmp_path, "offline")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="tiny")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=5, logger=logger, log_every_n_steps=1, default_root_dir=tmp_path,
        callbacks=[RunCheckpoints(tmp_path / "checkpoints", every_n_steps=2, keep_last=3)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Tiny())
    run_id = logger.experiment.id
    finish_wandb(logger)
    wandb.teardown()  # the service closes the .wandb file (finish alone may return before it is flushed)
    rows = _history(next((tmp_path / "wandb").glob("offline-run-*")))
    assert [row["trainer/global_step"] for row in rows] == [0, 1, 2, 3, 4]  # one row per step, W&B _step 0..4
    for step in (2, 4, 5):  # every 2 steps and at the end
        noted = wandb_step_of(tmp_path / "checkpoints" / f"step-{step:08d}")
        assert noted is not None and noted["run_id"] == run_id
        # The rows before the noted W&B step are exactly the steps before the checkpoint: rewinding there repeats
        # none and drops none (the saved step's own row is logged after the save; the note follows it).
        before = [row["trainer/global_step"] for row in rows if row["_step"] < noted["step"]]
        assert before == list(range(step)), (step, noted)


def _write_note(folder: Path, step: int, record: dict[str, Any] | None) -> Path:
    checkpoint = folder / "checkpoints" / f"step-{step:08d}"
    checkpoint.mkdir(parents=True)
    (folder / "wandb" / "offline-run-20260101_000000-fromdir").mkdir(parents=True)
    (folder / "wandb" / "offline-run-20260101_000000-fromdir" / "run-fromdir.wandb").touch()
    if record is not None:
        (folder / "checkpoints" / "wandb.json").write_text(json.dumps({checkpoint.name: record}))
    return checkpoint


def _continue(folder: Path, checkpoint: Path, overrides: tuple[str, ...] = ()) -> Any:
    cfg = compose_config(["logger=wandb", *overrides])
    return build_logger(cfg.logger["wandb"], folder, cfg, continue_from=checkpoint)


def test_online_continuation_rewinds_offline_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = _write_note(tmp_path, 40, {"run_id": "abc123", "step": 7})
    _wandb_env(monkeypatch, tmp_path, "online")
    init = _continue(tmp_path, checkpoint)._wandb_init
    assert init["resume_from"] == "abc123?_step=6"  # rows _step 0..6 kept; the resumed run logs from _step 7
    assert init["resume"] is None and init["id"] is None  # wandb refuses resume / a second id beside resume_from
    assert "resume_from" not in _continue(tmp_path, checkpoint, ("logger.wandb.mode=offline",))._wandb_init
    for mode in (None, "offline"):  # offline by default (no API key), and WANDB_MODE=offline
        _wandb_env(monkeypatch, tmp_path, mode)
        init = _continue(tmp_path, checkpoint)._wandb_init
        assert (init["id"], init["resume"], init.get("resume_from")) == ("abc123", "allow", None)
    _wandb_env(monkeypatch, tmp_path, "online")
    old = _write_note(tmp_path / "old", 40, None)
    again = tmp_path / "old" / "wandb" / "offline-run-20260101_000000-fromdir-1"  # wandb's name for a 2nd start
    again.mkdir()
    (again / "run-fromdir.wandb").touch()
    no_note = _continue(tmp_path / "old", old)._wandb_init  # no note: the id of the folder's newest W&B run
    assert (no_note["id"], no_note["resume"], no_note.get("resume_from")) == ("fromdir", "allow", None)


def test_a_refused_rewind_continues_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import wandb

    checkpoint = _write_note(tmp_path, 40, {"run_id": "abc123", "step": 7})
    _wandb_env(monkeypatch, tmp_path, "online")
    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> object:
        calls.append(kwargs)
        if kwargs.get("resume_from"):
            raise wandb.errors.CommError("failed to rewind run: run not found")  # what wandb-core answers
        return "the run"

    monkeypatch.setattr(wandb, "init", init)
    assert _continue(tmp_path, checkpoint).experiment == "the run"
    assert [(c.get("resume_from"), c.get("id"), c.get("resume")) for c in calls] == [
        ("abc123?_step=6", None, None),
        (None, "abc123", "allow"),
    ]
    assert "may appear twice" in capsys.readouterr().err


def test_offline_resume_writes_a_second_folder_and_restarts_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What docs/concepts/telemetry.md says of offline resumed runs, as wandb does it."""
    import wandb

    _wandb_env(monkeypatch, tmp_path, "offline")
    for n, kwargs in ((3, {"id": "same1", "resume": "allow"}), (2, {"id": "same1", "resume": "allow"})):
        run = wandb.init(project="tiny", dir=str(tmp_path), **kwargs)
        for i in range(n):
            run.log({"x": i})
        run.finish()
    wandb.teardown()  # the service closes the .wandb files
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert [folder.name.split("-")[3] for folder in folders] == ["same1", "same1"]  # one folder per start, same id
    assert [[row["_step"] for row in _history(folder)] for folder in folders] == [[0, 1, 2], [0, 1]]
    run = wandb.init(project="tiny", dir=str(tmp_path), resume_from="same1?_step=1")  # offline: noted for sync
    run.log({"x": 9})
    run.finish()
    wandb.teardown()
    (rewound,) = set((tmp_path / "wandb").glob("offline-run-*")) - set(folders)
    assert [row["_step"] for row in _history(rewound)] == [2]  # after the rewind point, as online
