"""Hub ids downloaded into the HuggingFace cache, against a local stand-in for the hub's HTTP API (no network):
``model.pretrained=<org/name>`` and ``data.path=<org/name>`` (a dataset repo), with the user's token, by one process
per node (the others wait and read the same files), nothing fetched once cached, and ``HF_HUB_OFFLINE=1`` as before
(the cache only)."""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_config

from lightning_dist.config.validate import validate
from lightning_dist.hub import hub_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from hub_standin import HubStandIn

pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = tmp_path / "served" / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2)).save_pretrained(model)  # fmt: skip
    (model / "pytorch_model.bin").write_bytes(b"not read: the safetensors are")
    data = tmp_path / "served" / "data"
    (data / "train").mkdir(parents=True)
    (data / "train" / "part-0.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(20)))
    with HubStandIn() as standin:
        standin.add("tiny-org/tiny-llama", model)
        standin.add("tiny-org/tiny-corpus", data, kind="dataset")
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        yield standin


def test_a_hub_model_is_downloaded_once_with_the_token_then_read_from_the_cache(hub: HubStandIn) -> None:
    cfg = compose_config([*[o for o in FAST if not o.startswith("model.")], "model=hf",
                          "model.pretrained=tiny-org/tiny-llama", "data.vocab_size=64"])  # fmt: skip
    valid = validate(cfg)
    folder = Path(valid.cfg.init_from)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not (folder / "pytorch_model.bin").exists()  # only what a run reads
    assert hub.fetched("model.safetensors") == 1
    assert {r["authorization"] for r in hub.requests if "/tiny-llama" in r["path"]} == {"Bearer hf_test_token"}
    before = len(hub.requests)
    assert Path(validate(cfg).cfg.init_from) == folder
    assert len(hub.requests) == before  # cached: no request at all


def test_a_node_s_other_processes_wait_for_local_rank_0_and_fetch_nothing(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    found: list[Path] = []
    waiter = threading.Thread(target=lambda: found.append(hub_snapshot("model.pretrained", "tiny-org/tiny-llama")))
    waiter.start()
    time.sleep(1.0)
    assert not found and hub.fetched("model.safetensors") == 0  # rank 1 waits, downloading nothing
    monkeypatch.setenv("LOCAL_RANK", "0")  # the node's rank 0 (here: this thread) downloads
    folder = hub_snapshot("model.pretrained", "tiny-org/tiny-llama")
    waiter.join(timeout=30)
    assert found == [folder] and hub.fetched("model.safetensors") == 1


def test_offline_mode_reads_the_cache_only(hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = r"^model.pretrained=tiny-org/tiny-llama is neither a local folder nor in the HuggingFace cache .* HF_HUB"
    with pytest.raises(ValueError, match=message):
        hub_snapshot("model.pretrained", "tiny-org/tiny-llama")
    assert not hub.requests
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError, match=r"^model.pretrained=tiny-org/nope: downloading it from the hub failed"):
        hub_snapshot("model.pretrained", "tiny-org/nope")


def test_a_hub_dataset_id_is_downloaded_and_read_as_a_folder(hub: HubStandIn, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"
    from helpers import make_tiny_tokenizer

    make_tiny_tokenizer(tokenizer, [f"line {i}" for i in range(20)], vocab_size=280)
    # its 6 windows of 8 tokens: a global batch of 2 to train on (checked before launch)
    cfg = compose_config([*FAST, "data=hf", "data.path=tiny-org/tiny-corpus", f"data.tokenizer={tokenizer}",
                          "data.seq_len=8", "data.sample_by=line", "data.num_proc=1",
                          f"data.cache_dir={tmp_path / 'tokens'}", "model.vocab_size=300",
                          "data.global_batch_size=2"])  # fmt: skip
    valid = validate(cfg)
    assert (Path(valid.cfg.data.path) / "train" / "part-0.jsonl").is_file()
    assert hub.fetched("part-0.jsonl") == 1


def test_lightning_dist_prepare_reads_a_hub_dataset_id(hub: HubStandIn, tmp_path: Path) -> None:
    import numpy as np
    from helpers import make_tiny_tokenizer

    from lightning_dist.data import corpus
    from lightning_dist.run.prepare import prepare

    lines = [f"line {i}" for i in range(20)]
    tokenizer = make_tiny_tokenizer(tmp_path / "tok", lines, vocab_size=280, chat_template=None)
    prepare(["tiny-org/tiny-corpus"], tmp_path / "out", str(tokenizer), val_fraction=0, num_proc=1)
    tok = corpus.load_tokenizer(str(tokenizer))
    expected = [t for line in lines for t in [*tok(line)["input_ids"], tok.eos_token_id]]
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist() == expected
    assert hub.fetched("part-0.jsonl") == 1


def test_a_streamed_mixture_s_hub_sources_stay_on_the_hub_and_its_val_path_is_downloaded(
    hub: HubStandIn, tmp_path: Path
) -> None:
    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps({"text": f"local {i}"}) + "\n" for i in range(8)))
    cfg = compose_config([*FAST, "data=hf", "data.streaming=true", f"data.path=[tiny-org/tiny-corpus,{local}]",
                          "data.weights=[1,2]", "data.tokenizer=/unused",
                          "data.val_path=tiny-org/tiny-corpus"])  # fmt: skip
    from lightning_dist.hub import resolve_data_path

    resolve_data_path(cfg.data)
    hubbed, kept = cfg.data.path
    assert hubbed == "hf://datasets/tiny-org/tiny-corpus@0123456789abcdef0123456789abcdef01234567"
    assert kept == str(local)
    assert (Path(cfg.data.val_path) / "train" / "part-0.jsonl").is_file()  # validation reads a cached corpus


@pytest.fixture
def streamed(hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubStandIn:
    """The stand-in, also for datasets and huggingface_hub already imported: they read HF_ENDPOINT (and datasets its
    cache folder) on import, which a run's ranks do with the environment already set."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.url + "/{repo_id}/resolve/{revision}/{filename}")  # fmt: skip
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", hub.url)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", hub.url + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))  # datasets' downloads
    return hub


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "txt"])
def test_a_streamed_hub_dataset_is_read_by_range_requests_as_its_local_files_and_resumes_exactly(
    streamed: HubStandIn, tmp_path: Path, suffix: str
) -> None:
    from helpers import make_tiny_tokenizer

    from lightning_dist.data.datamodule import TokenDataModule
    from lightning_dist.data.streaming import build_streamed_windows

    texts = [f"record {i}: {'some words ' * (i % 4)}of the hub corpus." for i in range(48)]
    folder = tmp_path / "served" / "streamed"
    (folder / "data").mkdir(parents=True)
    for part in range(2):  # two data files: the stream reads one after the other
        rows = texts[part * 24 : (part + 1) * 24]
        if suffix == "jsonl":
            (folder / "data" / f"train-{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
        elif suffix == "txt":  # a record per paragraph (data.sample_by), as from disk
            (folder / "data" / f"train-{part}.txt").write_text("\n\n".join(rows))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": rows}), folder / "data" / f"train-{part}.parquet", row_group_size=8)
    streamed.add("tiny-org/streamed", folder, kind="dataset")
    tokenizer = make_tiny_tokenizer(tmp_path / "tok", texts, chat_template=None)
    common = [*FAST, "data=hf", "data.streaming=true", f"data.tokenizer={tokenizer}", "data.seq_len=8",
              "model.vocab_size=300", "data.sample_by=paragraph"]  # fmt: skip
    from_hub = validate(compose_config([*common, "data.path=tiny-org/streamed"])).cfg.data
    assert from_hub.path == "hf://datasets/tiny-org/streamed@0123456789abcdef0123456789abcdef01234567"  # pinned
    from_disk = validate(compose_config([*common, f"data.path={folder / 'data'}"])).cfg.data
    TokenDataModule(from_hub).setup()  # what a rank checks before training: nothing local to find for a hub source

    def windows(cfg, take: int, state: dict | None = None) -> tuple[list[list[int]], dict]:
        dataset = build_streamed_windows(cfg, rank=0, world_size=1, kept=1)
        if state is not None:
            dataset.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint holds it
        out = [torch.cat([x, y[-1:]]).tolist() for _, (x, y) in zip(range(take), dataset)]
        return out, dataset.state_dict()

    expected, _ = windows(from_disk, 80)  # past the first pass (67 windows) into the second
    got, _ = windows(from_hub, 80)
    assert got == expected
    first, state = windows(from_hub, 23)  # mid-stream: inside the first file (parquet: its second row group)
    rest, _ = windows(from_hub, 80 - 23, state)
    assert first + rest == expected
    reads = [r for r in streamed.requests if r["method"] == "GET" and r["path"].endswith(f".{suffix}")]
    assert reads and all(r["range"] and r["authorization"] == "Bearer hf_test_token" for r in reads)
    assert not list((tmp_path / "cache").glob("datasets--*"))  # no snapshot in the HF cache: nothing downloaded


def test_a_streamed_hub_dataset_offline_reads_the_cache_or_stops_with_one_line(
    streamed: HubStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_config([*FAST, "data=hf", "data.streaming=true", "data.path=[tiny-org/tiny-corpus]",
                          "data.tokenizer=/unused"])  # fmt: skip
    from lightning_dist.hub import resolve_data_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = (r"^data.path=tiny-org/tiny-corpus is not in the HuggingFace cache \(.*\) and HF_HUB_OFFLINE is set, so "
               r"it cannot be streamed from the hub; unset HF_HUB_OFFLINE, or download it first \(hf download "
               r"tiny-org/tiny-corpus --repo-type dataset\)")  # fmt: skip
    with pytest.raises(ValueError, match=message) as err:
        resolve_data_path(copy.deepcopy(cfg.data))
    assert "\n" not in str(err.value) and not streamed.requests
    monkeypatch.delenv("HF_HUB_OFFLINE")
    folder = hub_snapshot("data.path", "tiny-org/tiny-corpus", kind="dataset")  # downloaded (hf download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_data_path(cfg.data)
    assert list(cfg.data.path) == [str(folder)]  # cached: read from disk
    with pytest.raises(ValueError, match=r"^data.path=tiny-org/nope: looking it up on the hub failed"):
        monkeypatch.delenv("HF_HUB_OFFLINE")
        resolve_data_path(compose_config([*FAST, "data=hf", "data.streaming=true", "data.path=tiny-org/nope",
                                          "data.tokenizer=/unused"]).data)  # fmt: skip


def test_with_streams_each_rank_fetches_only_its_own_shards_of_a_hub_dataset(
    streamed: HubStandIn, tmp_path: Path
) -> None:
    """data.num_streams=4 on 4 data-parallel ranks: rank r fetches files r and r + 4 of the 8 (the bytes the stand-in
    served, counted per file), and of the others only the first chunk of the first file, which datasets reads once to
    learn the records' columns; with one stream every rank fetches all 8. The ranks' windows are one process's with
    the same streams."""
    from helpers import make_tiny_tokenizer

    from lightning_dist.data.streaming import build_streamed_windows

    texts = [f"record {i}: {'some words ' * (i % 5)}of shard {i % 8}." for i in range(96)]
    folder = tmp_path / "served" / "sharded"
    (folder / "data").mkdir(parents=True)
    for shard in range(8):
        rows = texts[shard * 12 : (shard + 1) * 12]
        (folder / "data" / f"train-{shard}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    sizes = {
        f"data/train-{shard}.jsonl": (folder / "data" / f"train-{shard}.jsonl").stat().st_size for shard in range(8)
    }
    streamed.add("tiny-org/sharded", folder, kind="dataset")
    tokenizer = make_tiny_tokenizer(tmp_path / "tok", texts, chat_template=None)
    overrides = [*FAST, "data=hf", "data.streaming=true", f"data.tokenizer={tokenizer}", "data.seq_len=8"]
    overrides += ["model.vocab_size=300", "data.path=tiny-org/sharded"]

    def read_by_ranks(num_streams: int, world: int, take: int) -> tuple[list[dict[str, int]], list[list[list[int]]]]:
        cfg = validate(compose_config([*overrides, f"data.num_streams={num_streams}"])).cfg.data
        read, windows = [], []
        for rank in range(world):
            streamed.requests.clear()
            dataset = build_streamed_windows(cfg, rank=rank, world_size=world, kept=1)
            windows.append([torch.cat([x, y[-1:]]).tolist() for _, (x, y) in zip(range(take), dataset)])
            read.append(streamed.bytes_read(".jsonl"))
        return read, windows

    read, windows = read_by_ranks(num_streams=4, world=4, take=40)  # past a pass over each rank's two files
    head = "data/train-0.jsonl"  # datasets reads the first file's first chunk (<= 10 MB) to learn the columns
    for rank in range(4):
        own = {f"data/train-{rank}.jsonl", f"data/train-{rank + 4}.jsonl"}
        assert set(read[rank]) <= own | {head}, rank  # nothing of another rank's shards
        assert all(read[rank][name] >= sizes[name] for name in own), rank  # its own, whole
        if head not in own:
            assert read[rank][head] == sizes[head], rank  # the head only, once (here the whole small file)
    _, one = read_by_ranks(num_streams=4, world=1, take=160)
    assert [w for group in zip(*windows) for w in group] == one[0]  # rank r's windows are r, r + 4, ...
    read, _ = read_by_ranks(num_streams=1, world=4, take=40)
    assert all(set(r) == set(sizes) for r in read)  # one stream: every rank reads every file


def test_a_three_source_mixture_by_config_and_cap_fetches_only_what_it_reads_and_follows_its_weights(
    streamed: HubStandIn, tmp_path: Path
) -> None:
    """lightning-dist-prepare with weights 0.2 / 0.3 / 0.5: a hub dataset's config (its files only downloaded), the
    same dataset's other config capped at 400 tokens (streamed: its first file fetched, the others never) and a local
    folder. Each source is written once; data=tokens reads the blend, whose token counts are each source's share
    within 3/4 of a window (three sources: 1 - 1/(2(3-1))) for every prefix, exactly at every 10 windows."""
    import numpy as np
    from helpers import make_tiny_tokenizer

    from lightning_dist.data.files import TokenDataset, blend_starts
    from lightning_dist.run.prepare import prepare

    folder = tmp_path / "served" / "mix"
    texts = {"small": [f"small {i}: a few words." for i in range(40)]}
    texts["big"] = [f"big {i}: {'many words ' * (i % 7)}here." for i in range(300)]
    for config, rows in texts.items():
        (folder / config).mkdir(parents=True)
        for part in range(3):
            chunk = rows[part::3]
            (folder / config / f"part-{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk))
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/*.jsonl\n" for c in texts)
        + "---\n"
    )
    streamed.add("tiny-org/mix", folder, kind="dataset")
    local = tmp_path / "local"
    local.mkdir()
    (local / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"local {i}: our own text."}) + "\n" for i in range(60))
    )
    tokenizer = make_tiny_tokenizer(tmp_path / "tok", [*texts["small"], *texts["big"]], chat_template=None)
    sources = ["tiny-org/mix?name=small", "tiny-org/mix?name=big&max_tokens=400", str(local)]
    meta = prepare(sources, tmp_path / "out", str(tokenizer), weights=[0.2, 0.3, 0.5], val_fraction=0, num_proc=1)
    read = streamed.bytes_read(".jsonl")
    assert set(read) == {"small/part-0.jsonl", "small/part-1.jsonl", "small/part-2.jsonl", "big/part-0.jsonl"}
    assert meta["sources"][1]["tokens"] == 400 and meta["blend"]["shares"] == [2, 3, 5]
    dataset = TokenDataset(str(tmp_path / "out"), "train", 8, "uint16")
    bounds = np.cumsum([0] + [s["train_tokens"] for s in meta["sources"]])
    starts = blend_starts(tmp_path / "out", "train", 8, int(bounds[-1]))  # where each window the dataset reads starts
    train = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
    assert all(dataset[n][0].tolist() == train[s : s + 8].tolist() for n, s in enumerate(starts))
    counts = np.zeros(3)
    for n in range(len(dataset)):
        start = int(starts[n])
        counts[np.searchsorted(bounds, start, side="right") - 1] += 9  # the source whose tokens the window holds
        share = np.array([0.2, 0.3, 0.5]) * (n + 1) * 9
        assert np.all(np.abs(counts - share) <= 0.75 * 9), (n, counts, share)
        if (n + 1) % 10 == 0:
            np.testing.assert_allclose(counts, share)  # exact at every period
    assert len(dataset) == meta["blend"]["train_tokens"] // 9 == 233


def test_a_hub_dataset_s_config_streams_and_its_files_and_split_prepare_reading_only_them(
    streamed: HubStandIn, tmp_path: Path
) -> None:
    """data.streaming=true with data.path=<id>?name=<config>: pinned before launch, the options kept, and each rank
    streams that config's files only (the windows of the same files read from disk). lightning-dist-prepare with
    ?data_files=<one file>&split=<split>: that file's tokens, no other file fetched."""
    import numpy as np
    from helpers import make_tiny_tokenizer

    from lightning_dist.data import corpus
    from lightning_dist.data.streaming import build_streamed_windows
    from lightning_dist.run.prepare import prepare

    folder = tmp_path / "served" / "configs"
    texts = {name: [f"{name} {i}: {'words ' * (i % 4)}end." for i in range(30)] for name in ("first", "second")}
    for name, rows in texts.items():
        (folder / name).mkdir(parents=True)
        for part in range(2):
            lines = "".join(json.dumps({"text": t}) + "\n" for t in rows[part::2])
            (folder / name / f"part-{part}.jsonl").write_text(lines)
    configs = "".join(f"- config_name: {n}\n  data_files:\n  - split: held\n    path: {n}/*.jsonl\n" for n in texts)
    (folder / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    streamed.add("tiny-org/configs", folder, kind="dataset")
    tokenizer = make_tiny_tokenizer(tmp_path / "tok", [*texts["first"], *texts["second"]], chat_template=None)
    common = [*FAST, "data=hf", "data.streaming=true", f"data.tokenizer={tokenizer}", "data.seq_len=8"]
    common += ["model.vocab_size=300"]
    hub = validate(compose_config([*common, 'data.path="tiny-org/configs?name=second&split=held"'])).cfg.data
    assert hub.path == f"hf://datasets/tiny-org/configs@{'0123456789abcdef' * 2}01234567?name=second&split=held"
    disk = validate(compose_config([*common, f"data.path={folder / 'second'}"])).cfg.data
    streamed.requests.clear()

    def windows(cfg) -> list[list[int]]:
        return [torch.cat([x, y[-1:]]).tolist() for _, (x, y) in zip(range(30), build_streamed_windows(cfg, 0, 1, 1))]

    assert windows(hub) == windows(disk)
    assert set(streamed.bytes_read(".jsonl")) == {"second/part-0.jsonl", "second/part-1.jsonl"}
    streamed.requests.clear()
    source = "tiny-org/configs?data_files=first/part-1.jsonl&split=train"
    prepare([source], tmp_path / "out", str(tokenizer), val_fraction=0, num_proc=1)
    tok = corpus.load_tokenizer(str(tokenizer))
    expected = [t for text in texts["first"][1::2] for t in [*tok(text)["input_ids"], tok.eos_token_id]]
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist() == expected
    assert set(streamed.bytes_read(".jsonl")) == {"first/part-1.jsonl"}
