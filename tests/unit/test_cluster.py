"""Who launched a process (only a real launcher's variables count), the job's run folder, SLURM requeue and the
preflight checks a torchrun / srun rank makes alone, each a one-line error."""

from __future__ import annotations

import copy
import os
import re
import socket
import stat
from pathlib import Path

import pytest
from helpers import FAST, compose_config

from lightning_dist import environment as where
from lightning_dist.checkpoint.folder import merge_parts
from lightning_dist.config.build import build_strategy
from lightning_dist.config.validate import build_parallel_dims
from lightning_dist.run import cluster, slurm
from lightning_dist.run.train import run

#: What srun sets in task 3 of a 2-node x 2-task job step.
SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "lightning-dist",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_NODELIST": "gpu[17-18]",
    "SLURM_STEP_NODELIST": "gpu[17-18]",
}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "job7", "LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}


def test_an_srun_task_is_detected_by_us_and_by_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    assert where.launcher(SRUN) == "slurm"
    assert where.run_dir("outputs", SRUN) == "outputs/slurm-4242"
    assert where.run_dir("outputs", {**SRUN, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}) == (
        "outputs/slurm-4240_2"
    )
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # Lightning writes them into os.environ: restored (absent) after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    environment = SLURMEnvironment(auto_requeue=False)
    assert SLURMEnvironment.detect()
    assert (environment.world_size(), environment.global_rank(), environment.local_rank()) == (4, 3, 1)
    assert (environment.node_rank(), environment.main_address) == (1, "gpu17")


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_PROCID": "0"},  # left over in a shell
        {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},  # the sbatch script itself, not srun
        {**SRUN, "SLURM_NTASKS": "1"},  # srun of one task: the app starts its own ranks
        {"LOCAL_RANK": "0"},  # not torchrun without its run id and world size
    ],
    ids=["stray-procid", "sbatch-script", "one-task", "stray-local-rank"],
)
def test_a_stray_variable_is_not_a_launcher(env: dict[str, str]) -> None:
    assert where.launcher(env) is None


def test_torchrun_and_restarts() -> None:
    assert where.launcher(TORCHRUN) == "torchrun"
    assert where.run_dir("outputs", TORCHRUN) == "outputs/torchrun-job7"
    assert where.restart_count({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert where.restart_count({**SRUN, "SLURM_RESTART_COUNT": "1"}) == 1
    assert where.restart_count({"SLURM_RESTART_COUNT": "1"}) == 0  # not a rank of a job


def _preflight(overrides: list[str], env: dict[str, str]) -> None:
    cfg = compose_config([*FAST, *overrides])
    cluster.preflight(cfg, build_parallel_dims(cfg), env)


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["cluster.devices=4"], {**TORCHRUN, "WORLD_SIZE": "2"},
         r"^torchrun started 2 processes on this node \(--nproc-per-node=2\) but cluster.devices=4; set "
         r"cluster.devices=2, or --nproc-per-node=4.$"),
        (["cluster.num_nodes=2"], {**TORCHRUN, "WORLD_SIZE": "8"},
         r"^torchrun started 8 processes in all but cluster.devices=2 x cluster.num_nodes=2 = 4; set "
         r"cluster.num_nodes=4.$"),
        (["cluster.devices=2", "cluster.num_nodes=2", "parallelism=tp_fsdp", "parallelism.tp=4"], SRUN,
         r"^parallelism.tp=4 does not divide cluster.devices=2 \(per node\): a tensor-parallel group would span"),
        (["cluster.num_nodes=2"], {**TORCHRUN, "MASTER_ADDR": "no-such-node.invalid"},
         r"^MASTER_ADDR=no-such-node.invalid does not resolve on .*; give the first node's hostname"),
    ],
    ids=["processes-per-node", "world-size", "tp-across-nodes", "master-address"],
)  # fmt: skip
def test_preflight_failures_are_one_line(overrides: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _preflight(overrides, env)


def test_a_busy_master_port_on_the_first_node_is_named() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**SRUN, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "MASTER_PORT": str(port)}
        with pytest.raises(ValueError, match=rf"^MASTER_PORT={port} is already in use on .*; export another"):
            _preflight(["cluster.num_nodes=2"], env)
    _preflight(["cluster.num_nodes=2"], env)  # free again


def test_rank_zero_requeues_the_job_or_array_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for name, value in {**SRUN, "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    slurm.requeue()
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    slurm.requeue()
    monkeypatch.setenv("SLURM_PROCID", "1")
    slurm.requeue()  # not rank 0: nothing
    assert calls.read_text().splitlines() == ["requeue 4242", "requeue 4240_2"]


HEADS = ["model.n_heads=8", "model.n_kv_heads=8"]


def test_the_dry_run_prints_the_sbatch_script_of_a_two_node_job(tmp_path: Path, capsys) -> None:
    pytest.importorskip("submitit")
    cfg = compose_config(
        [*FAST, "cluster=slurm", "cluster.num_nodes=2", "parallelism=tp_fsdp", "parallelism.tp=8", *HEADS,
         "cluster.slurm.partition=gpu", "cluster.slurm.account=proj7", "cluster.slurm.qos=high",
         "cluster.slurm.constraint=h100", "cluster.slurm.time_min=240", "cluster.slurm.cpus_per_task=12",
         "cluster.slurm.mem_gb=480", "cluster.slurm.setup=[module load cuda,source venv/bin/activate]",
         "cluster.slurm.dry_run=true"],
        tmp_path,
    )  # fmt: skip
    from lightning_dist.config.validate import validate

    valid = validate(cfg)  # on this GPU-less machine: a submission is not checked against local hardware

    cfg, dims = valid.cfg, valid.dims
    result = slurm.submit(cfg, f"tensor_parallel: {dims.describe()}", run)
    assert result["dry_run"] and result["job_id"] is None
    out = capsys.readouterr().out
    options = dict(line.removeprefix("#SBATCH --").split("=", 1) for line in out.splitlines() if "#SBATCH" in line)
    expected = {"nodes": "2", "ntasks-per-node": "8", "gpus-per-node": "8", "partition": "gpu", "account": "proj7",
                "qos": "high", "constraint": "h100", "time": "240", "cpus-per-task": "12", "mem": "480GB",
                "signal": "USR2@120", "job-name": "lightning-dist"}  # fmt: skip
    assert {key: options.get(key) for key in expected} == expected
    assert options["output"].startswith(str(tmp_path / ".submitit"))
    lines = out.splitlines()
    assert (
        lines.index("module load cuda")
        < lines.index("source venv/bin/activate")
        < next(i for i, line in enumerate(lines) if line.startswith("srun "))
    )
    assert "-m submitit.core._submit" in out
    assert "2 node(s) x 8 tasks, tensor_parallel: pp=1 dp_replicate=1 dp_shard=2 tp=8 (world 16)" in out
    assert "node 0: ranks 0-7; node 1: ranks 8-15" in out
    assert not (tmp_path / ".submitit").exists() or not list((tmp_path / ".submitit").glob("*.pkl"))  # nothing sent


@pytest.mark.parametrize("recipe", ["llama_8b_slurm_2x8_h100", "llama_70b_slurm_16x8_h100"])
def test_the_slurm_recipes_validate_and_keep_tensor_parallelism_inside_a_node(
    recipe: str, tmp_path: Path, capsys
) -> None:
    """Every check the app makes before submitting passes on this GPU-less login node; the dry run prints the job."""
    pytest.importorskip("submitit")
    from lightning_dist.config.validate import validate

    data = tmp_path / "tokens"
    data.mkdir()
    for split in ("train", "val"):
        # uint32 token ids: a global batch of windows (128 x 8193 tokens for the 70B recipe), checked before submitting
        (data / f"{split}.bin").write_bytes(b"\0" * 4 * 1_100_000)
    cfg = compose_config([f"recipe={recipe}", f"data.path={data}", "cluster.slurm.dry_run=true"], tmp_path / "run")
    valid = validate(cfg)
    cfg, dims = valid.cfg, valid.dims
    cluster.check_tensor_parallel_placement(dims.tp, cfg.cluster.devices, cfg.cluster.num_nodes)
    assert dims.world_size == 8 * cfg.cluster.num_nodes and dims.tp in (1, 8)
    slurm.submit(cfg, dims.describe(), run)
    assert f"#SBATCH --nodes={cfg.cluster.num_nodes}" in capsys.readouterr().out


def test_a_requeued_job_continues_and_a_reused_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    from lightning_dist._compat import checkpoint_metadata_file
    from lightning_dist.config.validate import validate

    step = tmp_path / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / checkpoint_metadata_file()).write_bytes(b"")
    merge_parts(step)  # published, with the manifest of its (placeholder) files
    for name, value in {**SRUN, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    overrides = [*FAST, "cluster.devices=2", "cluster.num_nodes=2"]
    with pytest.raises(ValueError, match=r"already holds a run's checkpoints \(newest step-00000004\); continue it"):
        validate(compose_config(overrides, tmp_path))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued
    # Which checkpoint a requeued job continues from: its files are placeholders, so their tensors go unchecked.
    monkeypatch.setattr("lightning_dist.config.start._check_ckpt_fits", lambda *args: None)
    cfg = compose_config(overrides, tmp_path)
    cfg = validate(cfg).cfg
    assert cfg.ckpt_path == str(step)


def test_lightning_reads_ranks_from_the_launcher_that_started_us(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun under srun (one agent per node): Lightning would take SLURM's task ids for ranks."""
    for name, value in {**SRUN, **TORCHRUN, "GROUP_RANK": "1", "MASTER_ADDR": "gpu17", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    (environment,) = cluster.lightning_environment()
    assert (type(environment).__name__, environment.global_rank(), environment.local_rank()) == (
        "TorchElasticEnvironment",
        3,
        1,
    )


def test_a_run_folder_one_node_cannot_see_is_named(tmp_path: Path) -> None:
    from types import SimpleNamespace

    def strategy(rank: int) -> SimpleNamespace:
        return SimpleNamespace(global_rank=rank, broadcast=lambda value: value, barrier=lambda: None)

    cluster.check_shared_folder(tmp_path, strategy(0))  # rank 0 sees what it wrote, and removes it
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match=rf"^the run folder {tmp_path} is not shared: rank 3 on .* does not see"):
        cluster.check_shared_folder(tmp_path, strategy(3))  # nothing was written there by "rank 0"


def test_a_torchrun_restart_continues_and_its_store_is_prefixed_by_the_attempt(tmp_path: Path, monkeypatch) -> None:
    """torchrun's agent keeps one store for every attempt: a restarted rank must not read the last attempt's keys."""
    import torch.distributed as dist

    from lightning_dist import _compat
    from lightning_dist._compat import checkpoint_metadata_file
    from lightning_dist.config.validate import validate

    step = tmp_path / "checkpoints" / "step-00000006"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / checkpoint_metadata_file()).write_bytes(b"")
    merge_parts(step)  # published, with the manifest of its (placeholder) files
    env = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Which checkpoint a restarted job continues from: its files are placeholders, so their tensors go unchecked.
    monkeypatch.setattr("lightning_dist.config.start._check_ckpt_fits", lambda *args: None)
    cfg = compose_config([*FAST, "cluster.devices=2"], tmp_path)
    cfg = validate(cfg).cfg
    assert cfg.ckpt_path == str(step)  # continued from the newest checkpoint of the job's folder

    calls = []
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: dist.HashStore())
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    strategy = type("S", (), {"_timeout": None, "_get_process_group_backend": lambda self: "gloo"})()
    _compat.init_after_torchrun_restart(strategy)
    (call,) = calls
    assert isinstance(call["store"], dist.PrefixStore) and (call["rank"], call["world_size"]) == (0, 2)
    call["store"].set("key", "value")  # lands under the attempt's prefix, not where attempt 0 wrote "key"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _compat.init_after_torchrun_restart(strategy)  # a first start: torch's own env:// init, nothing here
    assert len(calls) == 1


def test_the_sweep_launcher_reads_the_cluster() -> None:
    """``-m ... hydra/launcher=slurm``: Hydra's submitit launcher gets its job shape from cluster.* (job arrays)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose

    compose_config([])  # Hydra initialized on the app's configs
    overrides = ["cluster=slurm", "cluster.num_nodes=4", "cluster.slurm.partition=gpu", "cluster.slurm.time_min=90",
                 "hydra/launcher=slurm", "hydra.launcher.setup=[module load cuda]"]  # fmt: skip
    launcher = compose(config_name="train", overrides=overrides, return_hydra_config=True).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (4, 8, 8)
    assert (launcher.partition, launcher.timeout_min, list(launcher.setup), launcher.signal_delay_s) == (
        "gpu",
        90,
        ["module load cuda"],
        120,
    )
    local = compose(config_name="train", overrides=["cluster.devices=2", "hydra/launcher=slurm_local"],
                    return_hydra_config=True).hydra.launcher  # fmt: skip
    assert local._target_.endswith("LocalLauncher") and local.tasks_per_node == 2


def test_devices_and_nodes_are_read_from_torchrun_and_srun(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from lightning_dist.config.validate import validate

    assert where.launcher_sizes(TORCHRUN) == (2, 2)  # LOCAL_WORLD_SIZE=2 of WORLD_SIZE=4
    assert where.launcher_sizes(SRUN) == (2, 2)  # 2(x2) tasks per node, 4 in all
    assert where.launcher_sizes({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no launcher: the config decides
    for name in [*SRUN, "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**TORCHRUN, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    cfg = compose_config([*FAST, "cluster.devices=1"])  # neither number matches torchrun's: the launcher's win
    resolved = validate(cfg).cfg
    assert (resolved.cluster.devices, resolved.cluster.num_nodes) == (2, 2)
    assert (cfg.cluster.devices, cfg.cluster.num_nodes) == (1, 1)  # the input is left alone
    assert "cluster.devices=2 cluster.num_nodes=2: as torchrun started the job" in capsys.readouterr().err


def test_the_collective_timeout_is_a_config_field() -> None:
    from datetime import timedelta

    from lightning_dist.config.validate import validate

    valid = validate(compose_config([*FAST, "cluster.collective_timeout_s=90"]))
    assert build_strategy(valid.cfg, valid.dims)._timeout == timedelta(seconds=90)
    with pytest.raises(ValueError, match=r"^cluster.collective_timeout_s=0.0 must be > 0"):
        validate(compose_config([*FAST, "cluster.collective_timeout_s=0"]))


def test_the_nccl_flight_recorder_dumps_into_the_run_folder(tmp_path: Path) -> None:
    env: dict[str, str] = {"TORCH_FR_BUFFER_SIZE": "500"}  # the user's own setting wins
    cluster.enable_flight_recorder(tmp_path, "gpu", env)
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "500",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "flight_recorder" / "rank_"),
    }
    assert (tmp_path / "flight_recorder").is_dir()
    cpu: dict[str, str] = {}
    cluster.enable_flight_recorder(tmp_path, "cpu", cpu)
    assert cpu == {}  # gloo has none


def test_the_watchdog_names_the_rank_silent_past_its_allowance(tmp_path: Path) -> None:
    import time as clock

    from lightning_dist.callbacks import beat_file
    from lightning_dist.run.watchdog import Watchdog, watch_external_job

    env = {**TORCHRUN, "RANK": "2", "LOCAL_RANK": "0"}  # node 2 of 2, local rank 0: a watcher
    dog = watch_external_job(tmp_path, env)
    assert dog is not None
    dog.stop()
    folder = tmp_path / "heartbeats" / "attempt-0"
    assert env[beat_file.ENV] == str(folder / "2.beat")
    assert watch_external_job(tmp_path, {**TORCHRUN, "LOCAL_RANK": "1"}) is None  # beats only
    assert watch_external_job(tmp_path, {"RANK": "0", "WORLD_SIZE": "2"}) is None  # not torchrun / srun

    for rank, (step, allowed) in enumerate([(7, 60.0), (5, 3.0)]):
        (folder / f"{rank}.beat").write_text(f"{step} {allowed}\n")
    hangs: list[str] = []
    watchdog = Watchdog(folder, world_size=2, poll_s=0.05, on_hang=hangs.append)
    assert watchdog.check() is None  # both within their allowance
    old = clock.time() - 10
    os.utime(folder / "1.beat", (old, old))  # rank 1 silent for 10 s, allowed 3
    watchdog.start()
    deadline = clock.monotonic() + 10
    while not hangs and clock.monotonic() < deadline:
        clock.sleep(0.05)
    watchdog.stop()
    assert len(hangs) == 1 and watchdog.silent_ranks == [1]
    assert re.match(
        r"^rank 1: hung: no progress for 10 s after step 5 \(allowed 3 s; resilience.hang_timeout_s\)", hangs[0]
    )


def test_the_launcher_is_read_from_os_environ_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets' ``map(num_proc > 1)`` rebinds ``os.environ`` to a copy (datasets 3-4, arrow_dataset.py): a default
    argument bound to the old object would read a stale environment from then on."""
    rebound = copy.deepcopy(os.environ)  # what datasets puts back
    rebound.update({"TORCHELASTIC_RUN_ID": "7", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    rebound["TORCHELASTIC_RESTART_COUNT"] = "1"
    monkeypatch.setattr(os, "environ", rebound)
    assert where.launcher() == "torchrun" and where.restart_count() == 1
