"""Every shipped config composes, every group combination validates, and big models instantiate on meta."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers import CONF_DIR, compose_config, fresh_env

from lightning_dist.config.loggers import check_loggers
from lightning_dist.config.validate import build_parallel_dims
from lightning_dist.models.gpt import GPT

GROUPS = {
    group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for group in ("model", "data", "parallelism", "cluster", "trainer", "logger")
}
RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))

PUBLISHED_PARAMS = {"gpt2_124m": 124.4e6, "llama_1b": 1.236e9, "llama_8b": 8.03e9, "llama_70b": 70.55e9}


#: Options that build the user's own class (or a HuggingFace model) rather than the built-in GPT / data.
NOT_BUILTIN = ("custom", "hf")
GPT_MODELS = [model for model in GROUPS["model"] if model not in NOT_BUILTIN]
BUILTIN_DATA = [data for data in GROUPS["data"] if data not in NOT_BUILTIN]


def test_every_group_has_options() -> None:
    assert GPT_MODELS == ["deepseek_v2_lite", "gpt2_124m", "gpt_tiny", "llama_1b", "llama_70b", "llama_8b",
                          "mixtral_8x7b", "moe_tiny"]  # fmt: skip
    assert set(GROUPS["model"]) - set(GPT_MODELS) == {"custom", "hf"}
    assert {"ddp", "fsdp", "tp", "tp_fsdp"} <= set(GROUPS["parallelism"])
    assert BUILTIN_DATA == ["synthetic", "text", "tokens"]
    assert set(GROUPS["data"]) - set(BUILTIN_DATA) == {"custom", "hf"}
    assert GROUPS["cluster"] == ["gpu", "local_cpu", "node_8gpu", "slurm"]


@pytest.mark.parametrize(
    ("model", "parallelism", "cluster"),
    # cluster=slurm has node_8gpu's shape; its submission checks are tests/unit/test_cluster.py's
    list(itertools.product(GPT_MODELS, GROUPS["parallelism"], [c for c in GROUPS["cluster"] if c != "slurm"])),
)
def test_group_combinations_compose_with_typed_fields(model: str, parallelism: str, cluster: str) -> None:
    cfg = compose_config([f"model={model}", f"parallelism={parallelism}", f"cluster={cluster}"])
    assert isinstance(cfg.trainer.max_steps, int) and isinstance(cfg.model.d_model, int)
    getattr(cfg.model, "validate", lambda: None)()  # the built-in GPT's shape rules (model=hf: its config's own)
    world = cfg.cluster.devices * cfg.cluster.num_nodes
    fixed = cfg.parallelism.tp * cfg.parallelism.pp * cfg.parallelism.ep  # ep splits dp_shard
    if world % fixed:  # e.g. tp_fsdp (tp=2) on one GPU: must be refused with the numbers in the message
        with pytest.raises(ValueError, match=f"world_size={world}"):
            build_parallel_dims(cfg)
    else:
        dims = build_parallel_dims(cfg)
        assert dims.world_size == world and dims.tp * dims.pp * dims.dp_size == world


@pytest.mark.parametrize("data", BUILTIN_DATA)
@pytest.mark.parametrize("logger", GROUPS["logger"])
def test_data_and_logger_groups_compose(data: str, logger: str) -> None:
    overrides = [f"data={data}", f"logger={logger}"] + ([] if data == "synthetic" else ["data.path=somewhere"])
    cfg = compose_config(overrides)
    assert cfg.data.kind == data
    expected = {"none": set(), "many": {"csv", "tensorboard", "wandb"}}.get(logger, {logger})
    assert set(cfg.logger) == expected and all("_target_" in node for node in cfg.logger.values())
    check_loggers(cfg.logger)  # each logger's package is installed (the dev extra)


def test_custom_and_hf_models_compose_to_their_configs() -> None:
    from lightning_dist.config.schema import HFModelConfig, TargetConfig

    cfg = compose_config(["model=custom", "model._target_=mypkg.MyModule", "+model.width=16", "data=custom",
                          "data._target_=mypkg.MyData", "+data.batch_size=4"])  # fmt: skip
    assert cfg.model == TargetConfig("mypkg.MyModule", {"width": 16})
    assert cfg.data == TargetConfig("mypkg.MyData", {"batch_size": 4})
    assert compose_config(["model=hf", "model.config=tiny_qwen2"]).model == HFModelConfig(config="tiny_qwen2")
    with pytest.raises(Exception, match="_target_"):
        compose_config(["model=custom"])  # the class to build is required
    with pytest.raises(Exception, match=r"Error merging override model.n_layers=abc"):
        compose_config(["model.n_layers=abc"])  # the built-in model's fields stay typed


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_compose(recipe: str) -> None:
    cfg = compose_config([f"recipe={recipe}"])
    getattr(cfg.model, "validate", lambda: None)()  # the built-in GPT's shape rules (model=hf: its config's own)


def _my_recipe(folder: Path) -> Path:
    """A user's recipe folder: ``recipe/mine.yaml`` with a seed of its own."""
    (folder / "recipe").mkdir(parents=True)
    (folder / "recipe" / "mine.yaml").write_text("# @package _global_\nseed: 7\ntrainer:\n  max_steps: 3\n")
    return folder


def test_a_recipes_seed_wins_over_the_defaults(tmp_path: Path) -> None:
    """The probe: train.yaml's own ``seed: 1234`` came after the recipe in the defaults list and won, while the
    recipe's other keys applied."""
    folder = _my_recipe(tmp_path / "conf")
    cfg = compose_config([f"hydra.searchpath=[file://{folder}]", "recipe=mine"])
    assert (cfg.seed, cfg.trainer.max_steps) == (7, 3)
    assert compose_config([f"hydra.searchpath=[file://{folder}]", "recipe=mine", "seed=9"]).seed == 9  # the CLI last
    assert compose_config([]).seed == 1234


@pytest.mark.parametrize("given", ["--config-dir", "-cd", "hydra.searchpath"])
def test_a_mistyped_recipe_is_refused_with_a_search_path_too(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The probe: ``--config-dir`` skipped the name check, and a mistyped recipe ran the default job with exit 0."""
    from lightning_dist.run import train

    folder = _my_recipe(tmp_path / "conf")
    where = [f"hydra.searchpath=[file://{folder}]"] if given == "hydra.searchpath" else [given, str(folder)]
    monkeypatch.setattr("sys.argv", ["lightning-dist-train", *where, "recipe=mien"])
    with pytest.raises(SystemExit) as exited:
        train.main()
    assert exited.value.code == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: recipe=mien is not an option of recipe: use one of ") and "\n" not in line
    assert line.endswith("; did you mean recipe=mine?") and "tiny_ddp_cpu" in line  # every folder's recipes
    train._check_recipe([*where, "recipe=mine"])  # found in the user's folder: Hydra runs it
    train._check_recipe([*where, "recipe=mine,tiny_ddp_cpu"])  # a sweep over recipes: each one found


@pytest.mark.parametrize("model", sorted(PUBLISHED_PARAMS))
def test_big_models_instantiate_on_meta_with_published_sizes(model: str) -> None:
    cfg = compose_config([f"model={model}"])
    with torch.device("meta"):
        gpt = GPT(cfg.model)
    total = gpt.num_params(exclude_embedding=False)
    assert abs(total - PUBLISHED_PARAMS[model]) / PUBLISHED_PARAMS[model] < 0.01, total
    assert gpt.flops_per_token(1024) > 6 * gpt.num_params()


def test_global_batch_is_the_only_batch_setting(tmp_path: Path) -> None:
    """Layouts change the per-rank batch, never the global one."""
    from lightning_dist.data import TokenDataModule

    for overrides, per_rank in (
        (["cluster.devices=1"], 32),
        (["cluster.devices=2"], 16),
        (["parallelism=tp", "cluster.devices=2"], 32),
    ):
        cfg = compose_config(overrides)
        dims = build_parallel_dims(cfg)
        assert TokenDataModule.per_rank_batch_size(cfg.data.global_batch_size, dims.dp_size) == per_rank


def test_a_user_config_folder_on_the_search_path(tmp_path: Path) -> None:
    """``model/mine.yaml`` in the user's own folder, found through ``hydra.searchpath``, extending a shipped option."""
    import subprocess
    import sys

    import yaml

    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("defaults:\n  - gpt_tiny\n  - _self_\n\nn_layers: 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dist.run.train", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
         "model=mine", "--cfg", "job"],
        cwd=tmp_path, env=fresh_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    model = yaml.safe_load(done.stdout)["model"]
    assert (model["n_layers"], model["d_model"], model["n_kv_heads"]) == (3, 64, 2)  # mine's, then gpt_tiny's
