"""``resume=<run>`` alone continues a run with the run's own config (a HuggingFace LoRA run: before, the default GPT
was composed and refused with GPT field names), and training longer is one override under a warmup-stable-decay
schedule: from a checkpoint before the decay, the longer run is the run that was planned that long, step for step.

Through the console entry point, in this process, as a user types it (Hydra writes the run's .hydra/ there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


def _train(argv: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> str:
    """``lightning-dist-train <argv>`` in this process; its stderr (SystemExit: a one-line refusal)."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.run.train import main

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", *argv])
    capfd.readouterr()
    main()
    return capfd.readouterr().err


def _losses(run: Path) -> dict[int, float]:
    """The report's loss of each step of the run's last start."""
    history = json.loads((run / "report.json").read_text())["history"]
    return {int(record["step"]): record["train/loss"] for record in history}


@pytest.fixture
def run_args(tmp_path: Path) -> list[str]:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(tmp_path / "pretrained")
    common = [o for o in FAST if not o.startswith(("model.", "trainer.max_steps", "trainer.enable_checkpointing"))]
    lora = ["model=hf", f"model.pretrained={tmp_path / 'pretrained'}", "model.lora.rank=4", "optim.lr=1e-2"]
    wsd = ["optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.warmup_steps=1"]
    saving = ["checkpoint.every_n_steps=2", "checkpoint.keep_last=10", "cluster.devices=1"]
    return [*common, *lora, *wsd, *saving]


def test_resume_alone_continues_an_hf_lora_run_and_one_override_trains_it_longer(
    run_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    run, longer = tmp_path / "run", tmp_path / "longer"
    monkeypatch.chdir(tmp_path)
    _train([*run_args, "trainer.max_steps=4", f"output_dir={run}"], monkeypatch, capfd)
    first = _losses(run)
    # A crash after step 2's checkpoint: resume=<run>, nothing else, continues it as it was configured.
    (run / "checkpoints" / "step-00000004").unlink()  # one process: Lightning's single-file checkpoint
    err = _train([f"resume={run}"], monkeypatch, capfd)
    assert err.startswith("resume: the run's own overrides first: ") and "model=hf" in err
    assert _losses(run) == pytest.approx({3: first[3], 4: first[4]}, rel=1e-6)

    # Longer, from the end: step 4 is past the decay's start (step 2 of 4), so the run says where to continue from.
    with pytest.raises(SystemExit):
        _train([f"resume={run}", "trainer.max_steps=8"], monkeypatch, capfd)
    earlier = run / "checkpoints" / "step-00000002"
    assert f"continue from a checkpoint before it: resume={earlier})" in capfd.readouterr().err
    _train([f"resume={earlier}", "trainer.max_steps=8"], monkeypatch, capfd)
    resumed = _losses(run)
    # The run planned 8 steps long from the start: the same first steps (warmup, stable), then the continuation.
    _train([*run_args, "trainer.max_steps=8", f"output_dir={longer}"], monkeypatch, capfd)
    whole = _losses(longer)
    assert [first[1], first[2]] == pytest.approx([whole[1], whole[2]], rel=1e-6)
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
    assert resumed == pytest.approx({step: whole[step] for step in range(3, 9)}, rel=1e-6)
    # Once more, alone: the run is at its end, and says so (its summary had read "train/loss : nan").
    err = _train([f"resume={run}"], monkeypatch, capfd)
    assert "checkpoint step 8 is this run's end (trainer.max_steps=8): nothing is left to train" in err
