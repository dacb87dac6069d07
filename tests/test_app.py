"""End to end through the real console script ``lightning-dist-train``, as a user runs it."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = shutil.which("lightning-dist-train", path=str(Path(sys.executable).parent)) or "lightning-dist-train"
SHORT = ["trainer.max_steps=30", "trainer.val_check_interval=15", "trainer.log_every_n_steps=5", "data.seq_len=64"]


def train(*overrides: str, cwd: Path, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **extra_env}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [SCRIPT, *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_stepz=5"], r"^error: trainer.max_stepz is not an argument of lightning.Trainer; did you mean"),
        # A typo never passes: Hydra's hint (add a +) would run with the key ignored; a config group lists its options.
        (
            ["model.n_layer=4"],
            r"^error: model.n_layer is not a field of model \(GPTConfig\); did you mean model.n_layers",
        ),
        (
            ["+model.n_layer=4"],
            r"^error: model.n_layer is not a field of model \(GPTConfig\); did you mean model.n_lay",
        ),
        (["+optim.lrr=1"], r"^error: optim.lrr is not a field of optim \(OptimConfig\); did you mean optim.lr\?"),
        (
            ["parallelism=fsdp2"],
            r"^error: parallelism=fsdp2 is not an option of parallelism: use one of 3d, ddp, diloco, ep, fsdp, pp, tp, "
            r"tp_fsdp; did you mean parallelism=fsdp\?$",
        ),
        (["recipe=tiny_dp_cpu"], r"^error: recipe=tiny_dp_cpu is not an option of recipe: .*did you mean recipe=tiny_"),
        (["data.global_batch_size=0"], r"^error: data.global_batch_size=0 must be >= 1"),
        (["optim.lr=-1"], r"^error: optim.lr=-1.0 must be >= 0 \(the peak learning rate\)\.$"),
        (["trainer.max_steps=abc"], r"Value 'abc' of type 'str' could not be converted to Integer"),
        (["cluster=gpu"], r"^error: cluster.accelerator=gpu but no CUDA device is visible; use cluster=local_cpu"),
        (["cluster.devices=64"], r"^error: cluster.devices=64 CPU processes is too many for \d+ cores"),
        (["data=text", "data.path=missing.txt"], r"^error: data.path='missing.txt' matched no file"),
        (
            ["data.global_batch_size=7"],
            r"^error: data.global_batch_size=7 is not divisible by the data-parallel size 2",
        ),
        (
            ["parallelism.tp=2"],
            r"^error: parallelism.tp=2 is not possible with parallelism.strategy=ddp .*parallelism=tp",
        ),
        (["parallelism=tp", "parallelism.pp=2"], r"^error: parallelism.pp=2 is not possible .*parallelism=pp"),
        (["parallelism=tp", "model.n_kv_heads=1"], r"^error: tp=2 does not divide model.n_kv_heads=1"),
        (["parallelism.dp_shard=0"], r"^error: dp_shard=0 must be >= 1, or -1"),
        # An option of an earlier version's flat parallelism group, named by its section now.
        (
            ["parallelism.schedule=GPipe"],
            r"^error: parallelism.schedule is not .*did you mean parallelism.pipeline.schedule",
        ),
        (
            ["parallelism.cp_attention=auto"],
            r"^error: parallelism.cp_attention is not .*parallelism.context.attention\?",
        ),
        (
            ["parallelism.activation_checkpointing=full"],
            r"^error: parallelism.activation_checkpointing is a section of options, not one value; set its fields",
        ),
        (["telemetry.comm_timing_every_n_steps=0"], r"^error: telemetry.comm_timing_every_n_steps=0 must be >= 1"),
    ],
)
def test_bad_input_is_one_clear_line(
    overrides: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """The console entry point, called in this process (an interpreter start per case would cost seconds each)."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.run.train import main

    GlobalHydra.instance().clear()  # hydra.main initializes its own
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", *overrides, f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code not in (0, None)
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and "_schema" not in stderr
    assert re.search(message, stderr, re.MULTILINE), stderr[-2000:]
    assert not list(tmp_path.glob("*/checkpoints")), "nothing ran"


def _main_fails(argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> str:
    """What ``lightning-dist-train <argv>`` run in ``cwd`` writes to stderr, having exited with 1."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.run.train import main

    GlobalHydra.instance().clear()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    return capfd.readouterr().err


def test_a_run_folder_that_cannot_be_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Hydra makes the folder and writes its files there first: its failure is said in our one line too."""
    blocker = tmp_path / "a-file"  # tests run as root, which permissions do not stop: a file in the path does
    blocker.write_text("")
    stderr = _main_fails([f"output_dir={blocker / 'run'}", "cluster.devices=1"], tmp_path, monkeypatch, capfd)
    assert (
        stderr == f"error: {blocker / 'run'}: Not a directory; give a run folder that can be written (output_dir=...)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no stray outputs/<date>/<time>


def test_a_rank_error_is_one_line_even_where_its_traceback_cannot_be_saved(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """A full disk or a read-only run folder: the traceback goes to the temporary folder, the line to the terminal."""
    from lightning_dist.run.launch import RankFailedError
    from lightning_dist.run.train import _report_failure

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    error = RankFailedError(1, "OSError: [Errno 28] No space left on device", "Traceback (most recent call last): ...")
    _report_failure(error, blocker / "run")
    line = capfd.readouterr().err
    saved = Path(re.search(r"\(traceback: (/.*\.log)\)\n$", line).group(1))
    assert line.startswith("error: rank 1: OSError: [Errno 28] No space left on device  (traceback: ")
    assert saved.read_text() == error.details and line.count("\n") == 1
    saved.unlink()


def test_default_job_trains_and_writes_wandb_offline(tmp_path: Path) -> None:
    result = train(*SHORT, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = {
        k.strip(): v.strip() for k, v in (line.split(" : ", 1) for line in result.stdout.splitlines() if " : " in line)
    }
    assert float(summary["train/loss"]) < math.log(256) - 1.0  # learned well below the uniform guess
    assert float(summary["val/loss"]) > float(summary["loss floor"].split()[0])  # cannot beat the floor
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one W&B run for the whole job, not one per rank"
    data = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    assert b"train/loss" in data and b"val/loss" in data
    for key in (b"perf/tokens_per_sec", b"perf/step_ms", b"comm/dp/ms", b"comm/dp/busbw_gbps", b"memory/"):
        assert key in data, key  # telemetry reaches the W&B run
    # The summary names every output, and the app's own lines are in the run folder's log file too.
    assert summary["report"] == str(tmp_path / "run" / "report.html") and Path(summary["report"]).is_file()
    assert summary["log file"] == str(tmp_path / "run" / "train.log")
    log = (tmp_path / "run" / "train.log").read_text()
    assert "run directory : " in log and "Telemetry summary" in log and f"W&B run       : {runs[0]}" in log
    assert _warnings_from_our_code(result.stderr) == []
    checkpoints = tmp_path / "run" / "checkpoints"
    steps = int(summary["steps"].split()[0])
    assert (checkpoints / "latest").read_text().strip() == f"step-{steps:08d}"  # published at the end of training
    assert (checkpoints / f"step-{steps:08d}").is_file()  # Lightning's DDP writes one file
    _check_report(tmp_path / "run", world=2)


#: Warnings the default run showed before, each caused by our code: Lightning's advice for a tensor logged without
#: sync_dist (val/loss, val/ppl), its note when a checkpoint save does not say weights_only, wandb's for anonymous=None.
CAUSED_BY_US = ("sync_dist=True", "`weights_only` was not set", "anonymous setting")


def _warnings_from_our_code(stderr: str) -> list[str]:
    """Warning lines on stderr raised in our package, naming our metric keys, or known to come from our calls."""
    return [
        line
        for line in stderr.splitlines()
        if re.search(r"lightning_dist/\S+\.py:\d+: ", line)
        or re.search(r"Warning.*'(train|val|perf|comm|memory)/", line)
        or any(cause in line for cause in CAUSED_BY_US)
    ]


def _check_report(run_dir: Path, world: int) -> None:
    """The run report: a self-contained page (its plots embedded) with the layout and the planner's estimate."""
    from html.parser import HTMLParser

    from lightning_dist.telemetry.report import main as report_main

    class Page(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.images, self.headings, self.cells, self._tag = [], [], [], ""

        def handle_starttag(self, tag, attrs):
            self._tag = tag
            if tag == "img":
                self.images.append(dict(attrs)["src"])

        def handle_data(self, data):
            if self._tag == "h2":
                self.headings.append(data)
            elif self._tag in ("td", "th"):
                self.cells.append(data)

    (run_dir / "report.html").unlink()
    report_main([str(run_dir)])  # lightning-dist-report RUN_DIR writes it again
    page = Page()
    page.feed((run_dir / "report.html").read_text())
    assert len(page.images) == 3 and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert {"loss.png", "step_time.png", "throughput_memory.png"} <= set(page.headings)
    assert {"Which rank holds what", "compute (the rest)", "tokens/s per device"} <= set(page.headings + page.cells)
    assert [p.name for p in sorted(run_dir.glob("*.png"))] == ["loss.png", "step_time.png", "throughput_memory.png"]
    assert json.loads((run_dir / "report.json").read_text())["ranks"][world - 1]["rank"] == world - 1


def test_readme_example_override_with_text_data(tmp_path: Path) -> None:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    result = train(
        "model.n_layers=4",
        "trainer.max_steps=10",
        "cluster.devices=1",
        "seed=7",
        "logger=csv",
        "data=text",
        "data.path=README.md",
        "data.global_batch_size=4",
        "trainer.val_check_interval=5",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    assert any(row.get("train/loss") for row in rows) and any(row.get("val/loss") for row in rows)
    assert any(row.get("perf/tokens_per_sec") for row in rows) and any(row.get("memory/rss_gib") for row in rows)


def test_multirun_runs_each_job_once_in_its_own_directory(tmp_path: Path) -> None:
    result = train(
        "-m",
        "seed=1,2",
        "logger=csv",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=2",
        "data.seq_len=32",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        SLURM_PROCID="0",  # left over in the shell: not a launcher (it once made every job run twice)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    firsts = []
    for job in jobs:
        rows = [r for r in csv.DictReader((tmp_path / "sweep" / job / "csv" / "metrics.csv").open()) if r["train/loss"]]
        assert [int(r["step"]) for r in rows] == sorted({int(r["step"]) for r in rows})  # no step logged twice
        firsts.append(rows[0]["train/loss"])
    assert firsts[0] != firsts[1]  # different seeds really ran
    assert result.stdout.count("run directory :") == 2  # the sweep ran once, not once per rank
