"""data=hf data.streaming=true in the app: a weighted mixture of two sources, streamed; two data-parallel ranks give
the one-process curve (and val/loss, from a cached data.val_path), and a run resumed from a checkpoint taken
mid-stream (under another data-parallel size) continues the stream exactly: the losses of the uninterrupted run. The
sources are short: the first pass over them is 19 windows (2 steps and 3 windows), the second 20, so the run trains on
three passes, a global batch holds the end of one pass and the start of the next, and the checkpoint of step 4 is taken
in the second pass (before this was handled, an epoch ended with each pass, its last part-batch dropped, and that
resume continued from another window: other losses)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import FAST, losses, make_tiny_tokenizer, run_app

A = [f"alpha {i}: the quick brown fox jumps over the lazy dog number {i * 7 % 13}." for i in range(7)]
B = [f"beta {i}: a second source of other words, {i % 5} of them." for i in range(10)]
VAL = [f"alpha {i}: the quick brown fox jumps over the lazy dog number {i * 7 % 13}." for i in range(120)]
STOP, STEPS = 4, 8
ONE_PROCESS = ["parallelism=ddp", "cluster.devices=1"]  # one .ckpt file
DP2 = ["parallelism=fsdp", "cluster.devices=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The overrides of a streamed run: tiny GPT, tokenizer and two jsonl sources written here, weights 1 : 3."""
    root = tmp_path_factory.mktemp("streamed")
    tok = make_tiny_tokenizer(root / "tok", A + B, chat_template=None)
    paths = []
    for name, texts in (("a", A), ("b", B), ("val", VAL)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        paths.append(str(root / f"{name}.jsonl"))
    return [
        *FAST,
        "data=hf",
        "data.streaming=true",
        f"data.path=[{','.join(paths[:2])}]",
        "data.weights=[1,3]",
        f"data.tokenizer={tok}",
        "data.global_batch_size=8",
        "data.seq_len=32",
        "model.vocab_size=320",
        f"trainer.max_steps={STEPS}",
        "optim.decay_steps=10",
        "trainer.enable_checkpointing=true",
        f"checkpoint.every_n_steps={STOP}",
        f"data.val_path={paths[2]}",  # validation reads a cached corpus, as without streaming
        f"data.cache_dir={root / 'cache'}",
        "data.num_proc=1",
        f"trainer.val_check_interval={STEPS}",
        "trainer.limit_val_batches=2",
    ]


def test_streamed_mixture_under_dp2_and_resumed_mid_stream_continues_exactly(run: list[str], tmp_path: Path) -> None:
    whole = run_app([*run, *ONE_PROCESS], tmp_path / "one")
    assert len(losses(whole)) == STEPS
    dp2 = run_app([*run, *DP2], tmp_path / "dp2")  # each rank reads the stream and keeps every other window
    np.testing.assert_allclose(losses(dp2), losses(whole), rtol=1e-5)
    assert whole["val_loss"] is not None and dp2["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)
    # Saved at step 4 while the loader had read ahead: the position saved is the windows trained on, not those read.
    checkpoint = tmp_path / "one" / "checkpoints" / f"step-{STOP:08d}"
    position = torch.load(checkpoint, weights_only=False)["TokenDataModule"]["stream"]
    assert position["window"] == STOP * 8 and position["pass"] == 1  # in the second pass over the sources
    resumed = run_app([*run, *DP2, f"ckpt_path={checkpoint}"], tmp_path / "resumed")  # under another dp size
    assert [record["step"] for record in resumed["history"]] == [float(s) for s in range(STOP + 1, STEPS + 1)]
    np.testing.assert_allclose(losses(resumed), losses(whole)[STOP:], rtol=1e-5)
