"""A streamed corpus (lightning_dist/data/streaming.py): sources read as needed, tokenized and packed into windows per
source, blended by index, dealt to the ranks as one process's stream; with data.num_streams the sources' shards go to
streams and a rank reads only the streams of its windows, the batches the same under every data-parallel size; resumed
from its state, under the same or another number of ranks, it continues exactly."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import make_tiny_tokenizer

from lightning_dist.data import DataConfig, corpus
from lightning_dist.data.blend import Blend
from lightning_dist.data.streaming import StreamedWindows, build_streamed_windows, merge_states

A = [f"alpha {i}: the quick brown fox jumps over the lazy dog." for i in range(16)]
B = [f"beta {i}: a second source of other words." for i in range(24)]
SHARDS = 4  # each source's files: num_streams 1, 2 and 4 read only their own


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataConfig, object]:
    root = tmp_path_factory.mktemp("stream")
    tok = make_tiny_tokenizer(root / "tok", A + B, chat_template=None)
    for name, texts in (("a", A), ("b", B)):
        (root / name).mkdir()
        per = len(texts) // SHARDS
        for shard in range(SHARDS):
            rows = texts[shard * per : (shard + 1) * per]
            (root / name / f"part-{shard}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    data = replace(
        DataConfig(kind="hf", tokenizer=str(tok)),
        seq_len=15,
        streaming=True,
        path=[str(root / "a"), str(root / "b")],
        weights=[1, 3],
    )
    return data, corpus.load_tokenizer(str(tok))


def _dataset(data: DataConfig, rank: int = 0, world: int = 1, state: dict | None = None, **changes) -> StreamedWindows:
    dataset = build_streamed_windows(replace(data, **changes), rank, world, kept=8)
    if state is not None:
        dataset.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint holds it
    return dataset


def _take(dataset: StreamedWindows, take: int) -> list[list[int]]:
    return [torch.cat([x, y[-1:]]).tolist() for _, (x, y) in zip(range(take), dataset)]


def _global(data: DataConfig, world: int, steps: int, batch: int, **changes) -> list[list[list[int]]]:
    """Each step's global batch (its windows, sorted: the loss is a mean over them) read by ``world`` ranks."""
    per_rank = [_take(_dataset(data, rank, world, **changes), steps * batch // world) for rank in range(world)]
    per = batch // world
    return [sorted(w for rank in per_rank for w in rank[k * per : (k + 1) * per]) for k in range(steps)]


def _tokens(texts: list[str], tokenizer) -> list[int]:
    return [t for text in texts for t in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]]


def test_each_window_is_one_source_s_next_tokens_chosen_by_the_blend_pass_after_pass(setup) -> None:
    data, tokenizer = setup
    windows = _take(_dataset(data), 160)
    source, _ = Blend([1, 3]).index(160)
    alpha = [w for w, j in zip(windows, source) if j == 0]
    beta = [w for w, j in zip(windows, source) if j == 1]
    a, b = _tokens(A, tokenizer), _tokens(B, tokenizer)
    assert [t for w in alpha for t in w] == (a * 9)[: 16 * len(alpha)]  # in order, the passes continuing the tokens
    assert [t for w in beta for t in w] == (b * 9)[: 16 * len(beta)]
    assert len(alpha) * 16 > len(a) and len(beta) * 16 > 3 * len(b)  # into alpha's second pass, beta's fourth
    assert len(alpha) == 40 and len(beta) == 120  # 1 : 3 of the windows, so of the tokens


def test_three_sources_token_shares_follow_the_weights_within_the_documented_rounding(setup, tmp_path) -> None:
    data, tokenizer = setup
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps({"text": f"gamma {i}: third."}) + "\n" for i in range(30)))
    three = replace(data, path=[*data.path, str(c)], weights=[0.2, 0.3, 0.5])
    windows = _take(_dataset(three), 200)
    texts = (A, B, [json.loads(line)["text"] for line in c.read_text().splitlines()])
    streams = [np.array(_tokens(t, tokenizer) * 40)[: 16 * 200].reshape(-1, 16).tolist() for t in texts]
    counts = np.zeros(3, dtype=int)
    for n, window in enumerate(windows, start=1):  # each window is the next of one source's
        k = next(k for k in range(3) if streams[k][counts[k]] == window)
        counts[k] += 1
        # Tokens of each source among the first n windows: within 1 - 1/(2(J-1)) = 3/4 of a window of its share.
        assert np.all(np.abs(counts * 16 - np.array([0.2, 0.3, 0.5]) * n * 16) <= 0.75 * 16), (n, counts)
    assert counts.tolist() == [40, 60, 100]  # exact at every multiple of the period (10)


@pytest.mark.parametrize(("streams", "stop"), [(1, 1), (1, 13), (1, 40), (2, 13), (4, 27), (3, 19)])
def test_a_resume_continues_the_stream_exactly(setup, streams: int, stop: int) -> None:
    """3 streams of 4 files: datasets' fallback, every stream reading all the records and keeping every third."""
    data, _ = setup
    whole = _take(_dataset(data, num_streams=streams), 120)
    dataset = _dataset(data, num_streams=streams)
    first = _take(dataset, stop)
    rest = _take(_dataset(data, state=dataset.state_dict(), num_streams=streams), 120 - stop)
    assert first + rest == whole


def test_the_ranks_windows_together_are_one_process_s_and_resume_under_another_world_size(setup) -> None:
    data, _ = setup
    whole = _take(_dataset(data), 60)
    ranks = [_take(_dataset(data, rank, 2), 30) for rank in (0, 1)]
    assert [w for pair in zip(*ranks) for w in pair] == whole  # rank r: windows r, r+2, ...
    dataset = _dataset(data, 0, 2)
    taken = _take(dataset, 6)  # the loader has read 12 windows of the stream...
    state = dataset.state_at(8)  # ...but training took 8 (4 steps of a global batch of 2)
    assert len(taken) == 6 and state["window"] == 8
    assert _take(_dataset(data, 0, 1, state=state), 52) == whole[8:]  # resumed on one rank
    with pytest.raises(ValueError, match=r"^the stream's state before window 7 is not kept"):
        dataset.state_at(7)


def test_with_streams_every_data_parallel_size_trains_on_the_same_batches(setup) -> None:
    data, _ = setup
    one = _global(data, 1, steps=6, batch=8, num_streams=4)
    for world in (2, 4, 8):  # 8: each stream is read by one rank of two, which keeps every other window
        assert _global(data, world, steps=6, batch=8, num_streams=4) == one, world
    assert one != _global(data, 1, steps=6, batch=8)  # but another num_streams reads other windows


def test_with_streams_a_rank_reads_only_its_streams_and_their_states_merged_resume_under_any_size(setup) -> None:
    data, _ = setup
    assert [_dataset(data, rank, 2, num_streams=4).reads for rank in (0, 1)] == [[0, 2], [1, 3]]
    assert _dataset(data, 1, 8, num_streams=4).reads == [1]
    assert [_dataset(data, rank, 3, num_streams=4).reads for rank in (0, 2)] == [[0, 1, 2, 3]] * 2  # gcd 1: all
    whole = _take(_dataset(data, num_streams=4), 96)
    ranks = [_dataset(data, rank, 2, num_streams=4) for rank in (0, 1)]
    for dataset in ranks:
        _take(dataset, 10)  # 20 windows read; training took 16 (4 steps of a global batch of 4)
    parts = [dataset.state_at(16) for dataset in ranks]
    assert parts[0]["streams"][1] is None and parts[1]["streams"][0] is None  # each holds its own streams only
    state = merge_states(parts)
    for world in (1, 4):
        rest = [_take(_dataset(data, rank, world, state=state, num_streams=4), 80 // world) for rank in range(world)]
        assert [w for group in zip(*rest) for w in group] == whole[16:]
    other = r"^the checkpoint's stream position is of data.num_streams=4 and this run has data.num_streams=2; resume"
    with pytest.raises(ValueError, match=other):
        _dataset(data, state=state, num_streams=2)
    with pytest.raises(ValueError, match=r"^the checkpoint's stream position holds no state of stream 1"):
        _dataset(data, 0, 1, state=parts[0], num_streams=4)


def test_a_position_saved_before_streams_continues_a_single_source_and_refuses_a_mixture(setup) -> None:
    data, _ = setup
    single = replace(data, path=data.path[:1], weights=None)
    whole = _take(_dataset(single), 30)
    dataset = _dataset(single)
    _take(dataset, 9)
    new = dataset.state_dict()
    source = new["streams"][0]["sources"][0]
    old = {"window": 9, "pass": source["pass"], "stream": source["records"], "buffer": source["buffer"]}  # its format
    assert _take(_dataset(single, state=old), 21) == whole[9:]
    with pytest.raises(ValueError, match=r"^the checkpoint's stream position is of a mixture drawn record by record"):
        _dataset(data, state=old)


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
        (["data.path=a.jsonl", "data.num_streams=0"], r"^data.num_streams=0 must be >= 1"),
        (["data.path=a.jsonl", "data.streaming=false", "data.num_streams=4"], r"^data.num_streams=4 deals a streamed "
         r"corpus to streams; set data=hf data.streaming=true, or data.num_streams=1"),
        (["data.path='org/web?max_tokens=1e9'"], r"^data.path=org/web\?max_tokens=1e9: max_tokens caps a source "
         r"lightning-dist-prepare writes; .* drop max_tokens"),
        (["data.path='org/web?name=x'", "data.streaming=false"], r"^data.path=org/web\?name=x: a source's options "
         r"\(name=x\) are read by data.streaming=true"),
        (["data.path='web/?name=x'"], r"^data.path=web/\?name=x: name, split and data_files select a part of a hub "
         r"dataset, and web/ is local"),
        (["data.path='org/web?nme=x'"], r"^data.path=org/web\?nme=x: unknown option 'nme'"),
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

    data, _ = setup
    cfg = replace(data, seed=7, global_batch_size=4)
    module = TokenDataModule(cfg)
    assert module.val_dataloader() == []  # validation off without data.val_path
    loader = module.train_dataloader()
    first = [batch for _, batch in zip(range(3), loader)]
    expected = _take(_dataset(data), 12)
    assert [w for inputs, targets in first for w in torch.cat([inputs, targets[:, -1:]], 1).tolist()] == expected
    state = module.state_dict()  # no Trainer: step 0, the start of the stream (not the 12 windows read)
    assert state["stream"]["window"] == 0
    first_file = f"{data.path[0]}/part-0.jsonl"
    val = replace(cfg, val_path=first_file, cache_dir=str(tmp_path / "cache"), num_proc=1)
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

    data, tokenizer = setup
    with pytest.raises(ValueError, match=r"^data.path: the streamed source source 0 holds no records; point data"):
        next(iter(StreamedWindows([Empty()], tokenizer, replace(data, weights=None))))
