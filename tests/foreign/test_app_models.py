"""The Hydra app with a user's own model and data (model=custom, data=custom) and a HuggingFace model (model=hf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, compose_config, losses, run_app

from lightning_dist.config.validate import validate

#: FAST without the built-in model's and data's fields (a user's classes take their own arguments).
RUN = [o for o in FAST if not o.startswith(("model.", "data."))]
CUSTOM = ["model=custom", "model._target_=custom_models.TinyRegressor", "+model.width=8",
          "data=custom", "data._target_=custom_models.RegressionData"]  # fmt: skip
HF = [o for o in FAST if not o.startswith("model.")] + ["model=hf", "model.config=tiny_llama"]


def test_own_model_and_data_match_one_process_under_fsdp(tmp_path: Path) -> None:
    one = run_app([*RUN, *CUSTOM, "+data.batch_size=8", "parallelism=fsdp", "cluster.devices=1"], tmp_path / "one")
    two = run_app([*RUN, *CUSTOM, "+data.batch_size=4", "parallelism=fsdp", "cluster.devices=2"], tmp_path / "two")
    assert len(losses(one)) == 10
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)


@pytest.fixture(scope="module")
def hf_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*HF, "parallelism=fsdp", "cluster.devices=1"], tmp_path_factory.mktemp("hf_one"))


def test_hf_model_from_the_app_matches_one_process(hf_one_process: dict, tmp_path: Path) -> None:
    """Through the app's config and checks; every layout of the HF models themselves is in test_hf.py."""
    result = run_app([*HF, "parallelism=tp", "cluster.devices=2"], tmp_path)
    assert len(losses(result)) == 10
    np.testing.assert_allclose(losses(result), losses(hf_one_process), rtol=1e-5)


def test_a_target_that_does_not_import_is_one_line_before_launch() -> None:
    cfg = compose_config([*RUN, "model=custom", "model._target_=nowhere.Model"])
    with pytest.raises(ValueError, match=r"model._target_='nowhere.Model' cannot be imported"):
        cfg = validate(cfg).cfg
