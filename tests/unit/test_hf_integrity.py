"""What the project reads back of a checkpoint's ``hf/`` folder (``checkpoint.save_hf=true``) is covered by the
checkpoint's manifest and checked before it is loaded: ``lightning-dist-generate`` / ``-eval``, ``init_from`` and a
resume each refuse a flipped, truncated, removed or added file in one line. A checkpoint published with a manifest
that has lost it is damaged, not an older format.

The checkpoint is real: a tiny GPT's state written by :class:`RunCheckpoints` through DCP, with ``save_hf`` writing
``hf/`` through DCP's HuggingFace writer (one process, no process group); the damage is done to its bytes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import FAST, compose_config

from lightning_dist.callbacks.checkpoints import RunCheckpoints
from lightning_dist.checkpoint import store
from lightning_dist.checkpoint.folder import MANIFEST
from lightning_dist.checkpoint.hf_model import resolve_hf_model
from lightning_dist.config.start import resolve_start
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig

GPT = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "max_seq_len": 64}
WEIGHTS = "hf/model.safetensors"


def _publish(run_dir: Path, steps: list[int]) -> list[Path]:
    """Checkpoints of a tiny GPT (its ``hf/`` folder with them) published by RunCheckpoints, as a run does."""
    module = GPTModule(GPTConfig(**GPT), OptimConfig(), 3)
    module.configure_model()
    saver = RunCheckpoints(run_dir / "checkpoints", keep_last=len(steps), save_hf=True)

    def save_checkpoint(path: Path, **kwargs: Any) -> None:
        rest: dict[str, Any] = {"global_step": trainer.global_step, "hyper_parameters": dict(module.hparams)}
        saver.on_save_checkpoint(trainer, module, rest)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: no process group, one process
            store.save({"state_dict": module.state_dict()}, rest, path, global_rank=0)

    strategy = SimpleNamespace(barrier=lambda: None, broadcast=lambda value: value)
    trainer = SimpleNamespace(
        global_step=0, is_global_zero=True, strategy=strategy, save_checkpoint=save_checkpoint, lightning_module=module
    )
    umask = os.umask(0o022)
    try:
        for step in steps:
            trainer.global_step = step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                saver.save(trainer)
                saver.on_train_batch_start(trainer, module)  # the next step boundary: published
    finally:
        os.umask(umask)
    return [run_dir / "checkpoints" / f"step-{step:08d}" for step in steps]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run folder with two published checkpoints, each with its hf/ folder."""
    older, newest = _publish(tmp_path / "run", [2, 4])
    return tmp_path / "run", older, newest


def test_the_manifest_covers_the_hf_folder(run: tuple[Path, Path, Path]) -> None:
    _, _, newest = run
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest["version"] == 2
    assert {"hf/config.json", WEIGHTS} <= set(manifest["files"])
    assert store.damage(newest) is None and store.hf_folder_problem(newest / "hf") is None
    assert stat.S_IMODE((newest / WEIGHTS).stat().st_mode) == 0o644  # safetensors writes 0600: a server reads it
    assert resolve_hf_model(run[0]).folder == newest / "hf"


DAMAGE = {
    "a flipped bit": (_flip_byte, f"{WEIGHTS} does not match the CRC-32 written with it (its bytes changed)"),
    "a truncated file": (lambda p: p.write_bytes(p.read_bytes()[:1000]), f"{WEIGHTS} has 1000 bytes, not the"),
    "a removed file": (lambda p: p.unlink(), f"{WEIGHTS} is missing"),
}


@pytest.mark.parametrize("case", DAMAGE, ids=str)
def test_generate_and_eval_refuse_a_damaged_hf_folder_in_one_line(case: str, run: tuple[Path, Path, Path]) -> None:
    """The probe: a flipped bit loaded with exit 0 and other text; a truncated file gave a 27-line traceback."""
    pytest.importorskip("transformers")
    from lightning_dist.run.generate import main as generate_main

    run_dir, older, newest = run
    damage, problem = DAMAGE[case]
    damage(newest / WEIGHTS)
    for given in (run_dir, newest, newest / "hf"):  # the run, its checkpoint, or the folder itself
        with pytest.raises(ValueError) as refused:
            resolve_hf_model(given)
        assert str(refused.value).startswith(f"{newest / 'hf'} cannot be loaded ({problem}"), str(refused.value)
        assert str(refused.value).endswith(f"); the newest whole checkpoint there is {older}.")
    with pytest.raises(SystemExit) as exited:
        generate_main([str(run_dir), "hello", "--device", "cpu", "--max-new-tokens", "2"])
    message = str(exited.value.code)
    assert message.startswith("lightning-dist-generate: ") and problem in message and "\n" not in message
    assert store.damage(newest) is not None  # a resume passes it over too
    assert store.latest_checkpoint(run_dir / "checkpoints") == older


def test_a_file_added_to_the_hf_folder_is_refused(run: tuple[Path, Path, Path]) -> None:
    """transformers would read a stray shard (or a second weights file) that the checkpoint never held."""
    _, _, newest = run
    (newest / "hf" / "model-00002-of-00002.safetensors").write_bytes(b"not ours")
    assert store.hf_folder_problem(newest / "hf") == (
        f"hf/model-00002-of-00002.safetensors is not in its {MANIFEST} (added after it was written)"
    )


def test_init_from_a_damaged_hf_folder_fails_before_launch(run: tuple[Path, Path, Path], tmp_path: Path) -> None:
    newest = run[2]
    model = [f"model.{key}={value}" for key, value in GPT.items() if key != "max_seq_len"]
    cfg = compose_config([*FAST, *model, f"init_from={newest / 'hf'}"], tmp_path / "new")
    resolve_start(cfg)  # whole: fine
    _flip_byte(newest / WEIGHTS)
    with pytest.raises(ValueError, match=rf"^{newest / 'hf'} cannot be loaded \({WEIGHTS} does not match the CRC-32"):
        resolve_start(cfg)


def test_a_checkpoint_that_lost_its_manifest_is_damaged_not_older(run: tuple[Path, Path, Path]) -> None:
    """The probe: manifest.json deleted and a bit flipped loaded with a warning calling it an older checkpoint."""
    run_dir, older, newest = run
    (newest / MANIFEST).unlink()
    _flip_byte(newest / WEIGHTS)
    lost = f"its {MANIFEST} is missing (it was published with one: removed?), so its files cannot be checked"
    assert store.damage(newest) == lost
    with pytest.raises(ValueError, match=rf"^checkpoint {newest} cannot be loaded \({re.escape(lost)}\); the newest"):
        store.check_loadable(newest)
    assert store.latest_checkpoint(run_dir / "checkpoints") == older
    with pytest.raises(ValueError, match=r"cannot be loaded \(its manifest.json is missing"):
        resolve_hf_model(newest / "hf")


def test_an_exported_folder_is_checked_before_it_is_read(run: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from lightning_dist.checkpoint.export import main as export_main

    _, _, newest = run
    out = tmp_path / "exported"
    export_main([str(newest), str(out)])
    assert resolve_hf_model(out).folder == out
    _flip_byte(out / "model.safetensors")
    with pytest.raises(ValueError) as refused:
        resolve_hf_model(out)
    assert str(refused.value) == (
        f"{out} cannot be loaded (model.safetensors does not match the CRC-32 written with it (its bytes changed)); "
        f"export it again: lightning-dist-export {newest} {out} --overwrite."
    )


def test_a_checkpoint_from_before_manifests_still_loads_after_a_size_check(tmp_path: Path) -> None:
    """Written before manifests existed (no manifest, nothing in its Lightning file saying it had one)."""
    path = tmp_path / "checkpoints" / "step-00000002"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.save({"state_dict": {"w": torch.ones(4)}}, {"global_step": 2}, path, global_rank=0)
    assert store.damage(path) is None and "only its files' sizes were checked" in store.unchecked_note(path)
