"""``parallelism.replicas.recovery=torchft``: every config it cannot run is one line before any process starts."""

from __future__ import annotations

import importlib.util
import os

import pytest
from helpers import FAST, compose_config

from lightning_dist.config.validate import validate

FT = ["parallelism=fsdp", "parallelism.replicas.recovery=torchft"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.dp_replicate=1"], r"^parallelism.replicas.recovery=torchft .* dp_replicate=1; set "),
        (
            ["parallelism.dp_replicate=2", "parallelism.replicas.min_replicas=3"],
            r"^parallelism.replicas.min_replicas=3 exceeds the 2 replica groups",
        ),
        (
            ["parallelism.dp_replicate=2", "parallelism.sync=diloco"],
            r"^parallelism.sync=diloco with parallelism.replicas.recovery=torchft: ",
        ),
        (["parallelism.dp_replicate=2", "parallelism.replicas.group=2"], r"^parallelism.replicas.group=2 is not a "),
        (
            ["parallelism.dp_replicate=2", "parallelism.replicas.lighthouse=http://127.0.0.1:1"],
            r"^parallelism.replicas.lighthouse=http://127.0.0.1:1 cannot be reached",
        ),
        (
            ["parallelism.dp_replicate=2", "parallelism.replicas.lighthouse=nowhere"],
            r"^parallelism.replicas.lighthouse='nowhere' is not an address",
        ),
        (["parallelism.replicas.recovery=sometimes"], r"^parallelism.replicas.recovery='sometimes' is unknown"),
    ],
)
def test_a_torchft_config_that_cannot_run_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        validate(compose_config([*FAST, *FT, *overrides]))
    assert "\n" not in str(err.value)


def test_lightnings_ddp_and_a_missing_torchft_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^parallelism.replicas.recovery=torchft runs on the mesh strategies"):
        validate(compose_config([*FAST, "parallelism.dp_replicate=2", "parallelism.replicas.recovery=torchft"]))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else found(name, *a))
    with pytest.raises(ValueError, match=r"^parallelism.replicas.recovery=torchft needs torchft: pip install"):
        validate(compose_config([*FAST, *FT, "parallelism.dp_replicate=2"]))


def test_a_replica_group_plans_the_layout_without_its_replica_axis() -> None:
    """Each group builds its mesh from the whole job's layout less dp_replicate; the job's layout is validated."""
    valid = validate(compose_config([*FAST, *FT, "parallelism.dp_replicate=2", "cluster.devices=4"]))
    group = valid.dims.replica_group()
    assert (valid.dims.dp_replicate, valid.dims.dp_shard, valid.dims.world_size) == (2, 2, 4)
    assert (group.dp_replicate, group.dp_shard, group.world_size) == (1, 2, 2)


def _only_torchrun(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    """This process as a torchrun rank: its variables, none of another launcher's (an earlier in-process run's)."""
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_", "LIGHTNING_DIST_"))]:
        monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_under_torchrun_each_job_names_its_group_and_lighthouse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun each job is one replica group: its group and the Lighthouse come from the command line."""
    torchrun = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    _only_torchrun(monkeypatch, torchrun)
    overrides = [*FAST, *FT, "parallelism.dp_replicate=2", "cluster.devices=2"]
    with pytest.raises(ValueError, match=r"^parallelism.replicas.recovery=torchft under torchrun: each job is one of"):
        validate(compose_config(overrides))
    monkeypatch.setattr("lightning_dist.config.strategy_rules.check_reachable", lambda address: None)
    named = [*overrides, "parallelism.replicas.group=1", "parallelism.replicas.lighthouse=h:1"]
    valid = validate(compose_config(named))
    assert (valid.dims.world_size, valid.dims.replica_group().world_size) == (4, 2)  # this job is one group of two


def test_a_restarted_replica_group_rejoins_from_a_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarting one replica group's job: it copies a live peer's state (the peers are ahead of its own
    newest checkpoint); ckpt_path=torchft:peer needs the torchft recovery."""
    torchrun = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    _only_torchrun(monkeypatch, {**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"})
    monkeypatch.setattr("lightning_dist.config.strategy_rules.check_reachable", lambda address: None)
    group = ["parallelism.dp_replicate=2", "cluster.devices=2", "parallelism.replicas.group=1"]
    valid = validate(compose_config([*FAST, *FT, *group, "parallelism.replicas.lighthouse=h:1"]))
    assert valid.cfg.ckpt_path == "torchft:peer"
    with pytest.raises(ValueError, match=r"^ckpt_path=torchft:peer copies a live replica group's state, which needs "):
        validate(compose_config([*FAST, "ckpt_path=torchft:peer"]))
