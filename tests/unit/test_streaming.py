"""A streamed corpus (lightning_dist/data/streaming.py): a weighted mixture of sources read as needed, tokenized and
packed into windows, dealt to the ranks as one process's stream; resumed from its state, under the same or another
number of ranks, it continues exactly."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import make_tiny_tokenizer

from lightning_dist.data import DataConfig, corpus
from lightning_dist.data.streaming import StreamedWindows, streamed_mixture

A = [f"alpha {i}: the quick brown fox jumps over the lazy dog." for i in range(40)]
B = [f"beta {i}: a second source of other words." for i in range(60)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[str]], object, DataConfig]:
    root = tmp_path_factory.mktemp("stream")
    tok = make_tiny_tokenizer(root / "tok", A + B, chat_template=None)
    files = []
    for name, texts in (("a", A), ("b", B)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        files.append([str(root / f"{name}.jsonl")])
    data = replace(DataConfig(kind="hf", tokenizer=str(tok)), seq_len=15)
    return files, corpus.load_tokenizer(str(tok)), data


def _windows(setup, rank: int = 0, world: int = 1, state: dict | None = None, take: int | None = None):
    """This rank's first ``take`` windows (from ``state``), or (``take=None``) those of the first pass over the
    sources (the stream has no end: the window that holds the first pass's end and the second's start is left out)."""
    files, tokenizer, data = setup
    dataset = StreamedWindows(streamed_mixture(files, [1, 3], seed=7), tokenizer, data, rank, world)
    if state is not None:
        dataset.load_state_dict(state)
    out = []
    for inputs, targets in dataset:
        if take is None and dataset.state_dict()["pass"] > 0:
            break
        out.append(inputs.tolist() + targets[-1:].tolist())
        if take is not None and len(out) == take:
            break
    return out, dataset.state_dict()


def _one_pass_tokens(setup) -> list[int]:
    """The tokens of one pass over the mixture: its records in datasets' order, each tokenized with an EOS after."""
    files, tokenizer, _ = setup
    records = list(streamed_mixture(files, [1, 3], seed=7))
    return [t for r in records for t in [*tokenizer(r["text"])["input_ids"], tokenizer.eos_token_id]]


def test_the_mixture_draws_by_weight_and_packs_every_token(setup) -> None:
    windows, _ = _windows(setup)
    tokenizer = setup[1]
    text = tokenizer.decode([t for w in windows for t in w])
    assert text.count("alpha") >= len(A) and text.count("beta") >= len(B)  # every record of both, shorter repeated
    first = tokenizer.decode([t for w in windows[:20] for t in w])
    assert first.count("beta") > 1.5 * first.count("alpha")  # weights 1 : 3
    assert all(len(w) == 16 for w in windows)


@pytest.mark.parametrize("stop", [1, 13, 40])
def test_a_resume_continues_the_stream_exactly(setup, stop: int) -> None:
    whole, _ = _windows(setup)
    first, state = _windows(setup, take=stop)
    rest, _ = _windows(setup, state=json.loads(json.dumps(state)))  # the state survives a checkpoint's round trip
    assert first + rest == whole and len(whole) > stop


def test_the_stream_starts_a_second_pass_whose_windows_continue_the_tokens_and_resume_exactly(setup) -> None:
    tokens = _one_pass_tokens(setup)
    per_pass = len(tokens) // 16
    many = 2 * per_pass + 5  # into the third pass
    windows, state = _windows(setup, take=many)
    assert [t for w in windows for t in w] == (tokens * 3)[: 16 * many]  # pass after pass, tokens carried over
    assert state["pass"] == 2
    stop = per_pass + 3  # a position in the second pass
    first, state = _windows(setup, take=stop)
    assert state["pass"] == 1
    rest, _ = _windows(setup, state=json.loads(json.dumps(state)), take=many - stop)
    assert first + rest == windows
    files, tokenizer, data = setup  # under two ranks: the state before a second-pass window, resumed on one
    dataset = StreamedWindows(streamed_mixture(files, [1, 3], seed=7), tokenizer, data, 1, 2)
    taken = [w for _, w in zip(range(per_pass // 2 + 4), dataset)]
    boundary = 2 * (per_pass // 2 + 2)
    assert len(taken) == per_pass // 2 + 4 and dataset.state_at(boundary)["pass"] == 1
    rest, _ = _windows(setup, state=json.loads(json.dumps(dataset.state_at(boundary))), take=many - boundary)
    assert rest == windows[boundary:]


def test_the_ranks_windows_together_are_one_process_s_and_resume_under_another_world_size(setup) -> None:
    whole, _ = _windows(setup)
    ranks = [_windows(setup, rank, 2)[0] for rank in (0, 1)]
    assert [w for pair in zip(*ranks) for w in pair] == whole[: 2 * len(ranks[1])]  # rank r: windows r, r+2, ...
    files, tokenizer, data = setup
    dataset = StreamedWindows(streamed_mixture(files, [1, 3], seed=7), tokenizer, data, 0, 2)
    taken = [w for _, w in zip(range(6), dataset)]  # the loader has read 12 windows of the stream...
    state = json.loads(json.dumps(dataset.state_at(8)))  # ...but training took 8 (4 steps of a global batch of 2)
    assert len(taken) == 6
    rest, _ = _windows(setup, 0, 1, state=state)  # resumed on one rank
    assert rest == whole[8:]
    with pytest.raises(ValueError, match=r"^the stream's state before window 7 is not kept"):
        dataset.state_at(7)


STREAMING = ["data=hf", "data.streaming=true", "data.tokenizer=/unused"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.path=[a.jsonl,b.jsonl]", "data.streaming=false"], r"^data.path=\['a.jsonl', 'b.jsonl'\] is a list, "
         r"a mixture of sources, which only data.streaming=true reads; set data.streaming=true"),
        (["data.path=a.jsonl", "data.weights=[1,2]", "data.streaming=false"], r"^data.weights=\[1.0, 2.0\] weighs a "
         r"mixture, which only data.streaming=true reads"),
        (["data.path=[a.jsonl,b.jsonl]", "data.weights=[1]"], r"^data.weights=\[1.0\]: give one positive weight per "
         r"source of data.path \(2 sources\)"),
        (["data.path=[a.jsonl,b.jsonl]", "data.weights=[1,0]"], r"^data.weights=\[1.0, 0.0\]: give one positive"),
        (["data.path=a.jsonl", "data.format=chat"], r"^data.streaming=true reads data.format=text documents; "
         r"data.format=chat is cached only"),
        (["data.path=a.jsonl", "data.num_workers=2"], r"^data.num_workers=2 with data.streaming=true: .* set "
         r"data.num_workers=0"),
        (["data.path=[]"], r"^data.path=\[\]: give a path or hub id, or a non-empty list of them"),
        (["data=text", "data.streaming=true"], r"^data.streaming=true reads data=hf corpora; data.kind=text: set "),
        (["data=text", "data.streaming=false", "data.path=[a,b]"], r"^data.path=\['a', 'b'\] is a list; data.kind=text "
         r"reads one path"),
    ],
)  # fmt: skip
def test_bad_streaming_configs_stop_with_one_line(overrides: list[str], message: str) -> None:
    from helpers import FAST, compose_config

    from lightning_dist.data.config import validate_data_config

    cfg = compose_config([*FAST, *STREAMING, *overrides])
    with pytest.raises(ValueError, match=message) as err:
        validate_data_config(cfg.data)
    assert "\n" not in str(err.value)


def test_the_datamodule_streams_train_and_validates_on_data_val_path_or_not_at_all(setup, tmp_path) -> None:
    from lightning_dist.data.datamodule import TokenDataModule

    files, _, data = setup
    cfg = replace(data, path=[f[0] for f in files], weights=[1, 3], streaming=True, seed=7, global_batch_size=4)
    module = TokenDataModule(cfg)
    assert module.val_dataloader() == []  # validation off without data.val_path
    loader = module.train_dataloader()
    first = [batch for _, batch in zip(range(3), loader)]
    expected, _ = _windows(setup, take=12)
    assert [w for inputs, targets in first for w in torch.cat([inputs, targets[:, -1:]], 1).tolist()] == expected
    state = module.state_dict()  # no Trainer: step 0, the start of the stream (not the 12 windows read)
    assert state["stream"]["window"] == 0
    val = replace(cfg, val_path=files[0][0], cache_dir=str(tmp_path / "cache"), num_proc=1)
    assert len(TokenDataModule(val).val_dataloader().dataset) > 0  # data.val_path: cached windows, as usual


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_steps=-1", "+trainer.max_epochs=2"], r"^trainer.max_steps=-1 with data.streaming=true: a stream "
         r"has no epochs .* set trainer.max_steps=<n>"),
        (["data.val_path=v.jsonl", "trainer.val_check_interval=0.5"], r"^trainer.val_check_interval=0.5 is a fraction "
         r"of an epoch, .* give a count of steps"),
    ],
)  # fmt: skip
def test_a_stream_s_run_is_bounded_by_steps(overrides: list[str], message: str) -> None:
    from helpers import FAST, compose_config

    from lightning_dist.config.run_rules import check_run_fields

    cfg = compose_config([*FAST, *STREAMING, "data.path=a.jsonl", *overrides])
    with pytest.raises(ValueError, match=message):
        check_run_fields(cfg)


def test_sources_without_records_stop_with_one_line_rather_than_loop(setup) -> None:
    class Empty:  # a stream of no records (datasets' own loaders refuse an empty file before this)
        def __iter__(self):
            return iter(())

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    _, tokenizer, data = setup
    with pytest.raises(ValueError, match=r"^data.path: the streamed sources hold no records; point data.path at"):
        next(iter(StreamedWindows(Empty(), tokenizer, data)))
