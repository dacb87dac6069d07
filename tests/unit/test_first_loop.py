"""Small things a newcomer's first half hour met (issue 44): what the summary says when no validation ran, the
callbacks a user's own Trainer imports, and the docs' claims the code no longer makes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from helpers import FAST, compose_config

from lightning_dist.run.result import RunResult
from lightning_dist.run.train import _print_summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("overrides", "steps", "why"),
    [
        (FAST, 10, "validation off: trainer.limit_val_batches=0"),
        ([], 5, "no validation ran: it runs every trainer.val_check_interval=100 steps; the run took 5"),
    ],
)
def test_the_summary_says_why_there_is_no_val_loss(
    overrides: list[str], steps: int, why: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result = RunResult(output_dir=str(tmp_path), layout="ddp", steps=steps, train_loss=2.0, wall_time_s=1.0)
    _print_summary(result, compose_config(overrides))
    assert f"val/loss      : - ({why})\n" in capsys.readouterr().out


def test_lora_in_a_users_own_trainer_trains_the_adapters_only() -> None:
    """The Python entry point for LoRA (no app, no Hydra): a transformers model in HFCausalLM with a LoraConfig, fit by
    Lightning's own single-device strategy."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import torch
    from helpers import quiet_trainer
    from torch.utils.data import DataLoader

    from lightning_dist.models import HFCausalLM, LoraConfig
    from lightning_dist.models.lora import base_name

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(vocab_size=64, num_hidden_layers=2, max_position_embeddings=32, **sizes)
    net = transformers.LlamaForCausalLM(config)
    before = {name: param.detach().clone() for name, param in net.named_parameters()}
    module = HFCausalLM(net, lora=LoraConfig(rank=4, targets=["q_proj", "v_proj"]), lr=1e-2)
    trainer = quiet_trainer("auto", devices=1, max_steps=3)
    trainer.fit(module, DataLoader(torch.randint(0, 64, (12, 17)), batch_size=4))
    params = dict(module.model.named_parameters())
    adapters = {name for name in params if ".lora_" in name}
    assert len(adapters) == 2 * 2 * config.num_hidden_layers  # A and B of q_proj and v_proj in each block
    assert {name for name, param in params.items() if param.requires_grad} == adapters
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(params[name]) for name in adapters}
    for name, param in params.items():
        if name in adapters:
            assert ".lora_A." in name or param.abs().max() > 0, name  # B starts at zero: trained
        else:
            assert torch.equal(param, before[base_name(name)]), name  # the base is frozen


def test_a_users_trainer_imports_evalcallback_with_the_other_callbacks() -> None:
    import lightning_dist.callbacks as callbacks
    from lightning_dist.callbacks.evaluation import EvalCallback

    assert callbacks.EvalCallback is EvalCallback and "EvalCallback" in callbacks.__all__


#: Claims the code no longer makes: each was in the docs or the configs when issue 44 was filed.
FALSE_CLAIMS = (
    "nothing is ever downloaded",  # model.pretrained / data.path hub ids are downloaded into the HuggingFace cache
    "never downloaded",
    "nothing is downloaded",
    "hardware assumed",  # the model card names the devices the run ran on
    "eval/latest.json",  # lightning-dist-eval writes <run>/eval/<checkpoint>.json
)
#: Text about how the docs and benchmarks were made, not what they say.
HOW_IT_WAS_MADE = ("lent to the sessions", "under the device tool", "the issue note", "while it was being written")


def _found(paths: list[Path], phrases: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}: {phrase!r}"
        for path in paths
        for phrase in phrases
        if phrase in " ".join(path.read_text().lower().split())
    ]


def test_the_docs_make_no_claim_the_code_no_longer_makes() -> None:
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "lightning_dist" / "conf").rglob("*.yaml")]
    assert _found(docs, FALSE_CLAIMS) == []
    assert _found([*docs, *(ROOT / "benchmarks").glob("*.py")], HOW_IT_WAS_MADE) == []


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of requirement strings (``jsonargparse[signatures]>=4`` -> ``jsonargparse``)."""
    return {re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_the_install_pages_extras_are_pyprojects_and_the_dockerfiles() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    page = (ROOT / "docs" / "get-started" / "install.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("extra", "---"):
            rows[cells[0].strip("`")] = {name.strip().lower() for name in cells[1].split(",")}
    assert rows.pop("(none)") == _names(project["dependencies"])
    dev = {name.removeprefix("and ") for name in rows.pop("dev")}
    assert rows == {extra: _names(extras[extra]) for extra in extras if extra != "dev"}
    assert "every extra above" in dev
    assert _names(extras["dev"]) == set().union(*rows.values()) | (dev - {"every extra above"})
    dockerfile = re.search(r"^ARG EXTRAS=(\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert f"installs the package with `{dockerfile}`" in " ".join(page.split())


def test_the_summary_of_a_start_that_trained_nothing_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``resume=<run>`` of a finished run trains no step: its summary said ``train/loss : nan``."""
    nothing = RunResult(output_dir=str(tmp_path), layout="ddp", steps=40, train_loss=float("nan"), wall_time_s=1.0)
    _print_summary(nothing, compose_config(FAST))
    assert "train/loss    : - (no step trained or logged in this start)\n" in capsys.readouterr().out
    diverged = RunResult(output_dir=str(tmp_path), layout="ddp", steps=4, train_loss=float("nan"), wall_time_s=1.0,
                         history=[{"step": 4, "train/loss": float("nan")}])  # fmt: skip
    _print_summary(diverged, compose_config(FAST))
    assert "train/loss    : nan\n" in capsys.readouterr().out  # a loss that was logged is shown as it was
