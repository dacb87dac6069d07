"""data=hf data.streaming=true in the app: a weighted mixture of two sources, streamed; two data-parallel ranks give
the one-process curve (and val/loss, from a cached data.val_path), and a run resumed from a checkpoint taken
mid-stream (under another data-parallel size) continues the stream exactly: the losses of the uninterrupted run. The
sources are short (a pass over the first is 8.3 windows, over the second 5.2; weights 1 : 3 of the 64 windows), so the
run reads the first about twice and the second nine times, windows hold the end of one pass and the start of the next,
and the checkpoint of step 4 is taken in the second source's fifth pass (before passes were handled, an epoch ended
with each pass, its last part-batch dropped, and that resume continued from another window: other losses).

With data.num_streams=4 (each source four files) the sources' shards are dealt to 4 streams: one process, two ranks
(each reading two streams) and four ranks (each reading one, only its own files) train on the same batches; a
checkpoint of the two-rank run, whose rank 0 holds only the states of streams 0 and 2 (the ranks gather them), resumed
under four ranks continues it exactly."""

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
DP4 = ["parallelism=fsdp", "cluster.devices=4"]


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
    passes = [source["pass"] for source in position["streams"][0]["sources"]]
    assert position["window"] == STOP * 8 and passes == [0, 4]  # the second source in its fifth pass
    resumed = run_app([*run, *DP2, f"ckpt_path={checkpoint}"], tmp_path / "resumed")  # under another dp size
    assert [record["step"] for record in resumed["history"]] == [float(s) for s in range(STOP + 1, STEPS + 1)]
    np.testing.assert_allclose(losses(resumed), losses(whole)[STOP:], rtol=1e-5)


@pytest.fixture(scope="module")
def sharded(run: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The run's overrides with each source four files, dealt to data.num_streams=4."""
    root = tmp_path_factory.mktemp("sharded")
    paths = []
    for name, texts in (("a", A * 4), ("b", B * 4)):
        (root / name).mkdir()
        for shard in range(4):
            rows = [f"{text} (shard {shard})" for text in texts[shard::4]]
            (root / name / f"part-{shard}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
        paths.append(str(root / name))
    keep = [o for o in run if not o.startswith(("data.path=", "data.val_path=", "trainer.val_check_interval="))]
    return [*keep, f"data.path=[{','.join(paths)}]", "data.num_streams=4", "trainer.limit_val_batches=0"]


def test_with_streams_one_process_dp2_and_dp4_train_alike_and_dp2_resumes_under_dp4(
    sharded: list[str], tmp_path: Path
) -> None:
    whole = run_app([*sharded, *ONE_PROCESS], tmp_path / "one")
    dp2 = run_app([*sharded, *DP2], tmp_path / "dp2")  # each rank reads two streams
    np.testing.assert_allclose(losses(dp2), losses(whole), rtol=1e-5)
    checkpoint = tmp_path / "dp2" / "checkpoints" / f"step-{STOP:08d}"
    resumed = run_app([*sharded, *DP4, f"ckpt_path={checkpoint}"], tmp_path / "resumed")  # each rank reads one
    assert [record["step"] for record in resumed["history"]] == [float(s) for s in range(STOP + 1, STEPS + 1)]
    np.testing.assert_allclose(losses(resumed), losses(whole)[STOP:], rtol=1e-5)
