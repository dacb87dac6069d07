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
        dataset = build_streamed_windows(cfg, seed=0, rank=0, world_size=1, kept=1)
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
