"""data=hf: your own text tokenized with the model's tokenizer, packed into windows, cached once, dealt by dp rank."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import compose_config, make_tiny_tokenizer, write_instruction_jsonl

from lightning_dist.data import DataConfig, TokenDataModule, corpus, packed
from lightning_dist.data.packed import IGNORE_INDEX, hf_datasets

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i} times.\nsee you at {i}." for i in range(24)]
WINDOW = 17  # seq_len + 1


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prompts = [f"question {i}: what is {i} plus {i}? the answer is {2 * i}." for i in range(20)]
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), DOCS + prompts)


@pytest.fixture(scope="module")
def tokenizer(tok: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok, local_files_only=True)


def _cfg(path: Path, tok: Path, cache: Path, **kwargs) -> DataConfig:
    fields = {"seq_len": WINDOW - 1, "global_batch_size": 4, "num_proc": 1, **kwargs}
    return DataConfig(kind="hf", path=str(path), tokenizer=str(tok), cache_dir=str(cache), **fields)


def _docs(folder: Path, docs: list[str] = DOCS) -> Path:
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    return folder


def _all(data: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [data[split][i] for split in ("train", "val") for i in range(len(data[split]))]


def _windows(stream: list[int]) -> np.ndarray:
    count = len(stream) // WINDOW
    return np.array(stream[: count * WINDOW]).reshape(count, WINDOW)


def _rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(row) for row in torch.cat(batch, dim=1).tolist()]


# ------------------------------------------------------------------------------------------------------- packing
def test_documents_are_packed_with_eos_between_them_into_windows(tmp_path: Path, tok: Path, tokenizer) -> None:
    data = hf_datasets(_cfg(_docs(tmp_path / "corpus"), tok, tmp_path / "cache", val_fraction=0.25))
    eos = tokenizer.eos_token_id
    stream = [t for doc in DOCS for t in [*tokenizer(doc)["input_ids"], eos]]  # a plain tokenizer(text), EOS after
    windows = _windows(stream)
    got = _all(data)
    assert len(got) == len(windows) and len(data["val"]) == round(len(windows) * 0.25)  # the val split is the tail
    for (inputs, targets), window in zip(got, windows):
        assert inputs.tolist() == window[:-1].tolist() and targets.tolist() == window[1:].tolist()
    assert tokenizer.decode(windows.reshape(-1)).startswith(DOCS[0] + "<|endoftext|>" + DOCS[1])
    # The same documents as JSON lines (data.text_field) pack to the same windows.
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": doc}) + "\n" for doc in DOCS))
    records = hf_datasets(_cfg(tmp_path / "docs.jsonl", tok, tmp_path / "cache", text_field="body", val_fraction=0.25))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(_all(records), got, strict=True))


def test_instruction_loss_is_on_the_response_tokens_and_the_eos_only(tmp_path: Path, tok: Path, tokenizer) -> None:
    path = write_instruction_jsonl(tmp_path / "sft.jsonl", 20)
    long = {"prompt": "the quick brown fox jumps over the lazy dog " * 6, "response": " yes."}
    path.write_text(path.read_text() + json.dumps(long) + "\n")  # a window of prompt only: skipped (0 / 0 loss)
    data = hf_datasets(_cfg(path, tok, tmp_path / "cache", format="instruction"))
    ids: list[int] = []
    mask: list[int] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        prompt, response = (tokenizer(record[k], add_special_tokens=False)["input_ids"] for k in ("prompt", "response"))
        ids += [*prompt, *response, tokenizer.eos_token_id]
        mask += [0] * len(prompt) + [1] * (len(response) + 1)
    windows, masks = _windows(ids), _windows(mask)
    expected = np.where(masks[:, 1:] == 1, windows[:, 1:], IGNORE_INDEX)
    keep = masks[:, 1:].any(axis=1)
    assert not keep.all()  # the long prompt fills a window with no target
    got = _all(data)
    assert len(got) == keep.sum()
    for (inputs, targets), window, target in zip(got, windows[keep], expected[keep]):
        assert inputs.tolist() == window[:-1].tolist() and targets.tolist() == target.tolist()
    assert any((t == IGNORE_INDEX).any() and (t != IGNORE_INDEX).any() for _, t in got)


def _chat(i: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"what is {i} plus {i}?"},
        {"role": "assistant", "content": f"the answer is {2 * i}."},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": f"see you at {i}."},
    ]


def test_chat_is_rendered_by_the_template_and_trains_on_the_assistant(tmp_path: Path, tok: Path, tokenizer) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": _chat(i)}) + "\n" for i in range(12)))
    data = hf_datasets(_cfg(path, tok, tmp_path / "cache", format="chat", val_fraction=0.2))
    ids: list[int] = []
    mask: list[int] = []
    for i in range(12):  # the whole rendered conversation, the assistant spans found in its text
        text = tokenizer.apply_chat_template(_chat(i), tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans, start = [], 0
        while (start := text.find("<|assistant|>", start)) >= 0:
            start += len("<|assistant|>")
            spans.append((start, text.index("<|end|>", start) + len("<|end|>")))
        ids += [*encoded["input_ids"], tokenizer.eos_token_id]
        mask += [int(any(a <= s < b for a, b in spans)) for s, _ in encoded["offset_mapping"]] + [1]
    windows, masks = _windows(ids), _windows(mask)
    keep = masks[:, 1:].any(axis=1)  # a window of user text only is skipped
    got = _all(data)
    assert len(got) == keep.sum()
    for (inputs, targets), window, m in zip(got, windows[keep], masks[keep]):
        assert inputs.tolist() == window[:-1].tolist()
        assert targets.tolist() == np.where(m[1:] == 1, window[1:], IGNORE_INDEX).tolist()
    learned = tokenizer.decode([t for _, targets in got for t in targets.tolist() if t != IGNORE_INDEX])
    assert "<|end|><|endoftext|>" in learned and "what is" not in learned and "<|user|>" not in learned


def test_chat_without_a_template_is_role_lines(tmp_path: Path) -> None:
    plain = make_tiny_tokenizer(tmp_path / "plain", DOCS, chat_template=None)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"talk": _chat(i)}) + "\n" for i in range(12)))
    cfg = _cfg(path, plain, tmp_path / "cache", format="chat", messages_field="talk", seq_len=255, val_fraction=0.5)
    inputs, targets = hf_datasets(cfg)["train"][0]
    tokenizer = corpus.load_tokenizer(str(plain))
    assert tokenizer.decode(inputs).startswith("user: what is 0 plus 0?\nassistant: the answer is 0.\nuser: and")
    learned = tokenizer.decode([t for t in targets.tolist() if t != IGNORE_INDEX])
    assert learned.startswith("the answer is 0.\nsee you at 0.\n<|endoftext|>the answer is 2.\n")


def test_a_folder_is_searched_in_sorted_order_without_its_hidden_folders(tmp_path: Path) -> None:
    folder = tmp_path / ".data" / "corpus"  # a hidden folder above data.path does not matter
    (folder / "b").mkdir(parents=True)
    (folder / ".cache").mkdir()
    for name in ("b/2.txt", "b/1.txt", "a.txt", ".cache/x.txt", "notes.md"):
        (folder / name).write_text("text")
    assert [f.relative_to(folder).as_posix() for f in corpus.corpus_files(str(folder))] == [
        "a.txt",
        "b/1.txt",
        "b/2.txt",
    ]


# --------------------------------------------------------------------------------------------------------- cache
def test_the_cache_is_written_once_and_keyed_by_the_sources(tmp_path: Path, tok: Path, monkeypatch) -> None:
    folder = _docs(tmp_path / "corpus")
    cfg = _cfg(folder, tok, tmp_path / "cache")
    calls = []
    tokenize = corpus.tokenize
    monkeypatch.setattr(corpus, "tokenize", lambda *args, **kwargs: calls.append(1) or tokenize(*args, **kwargs))
    first = hf_datasets(cfg)["train"].folder
    written = {f.name: f.stat().st_mtime_ns for f in first.iterdir()}
    assert sorted(written) == [".manifest.json", "meta.json", "tokens.npy", "windows.npy"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary folder left behind
    assert hf_datasets(cfg)["train"].folder == first and len(calls) == 1  # read, not tokenized again
    datamodule = TokenDataModule(cfg)  # a rank: Lightning's prepare_data, then setup, only open the cache
    datamodule.prepare_data()
    datamodule.setup()
    assert len(datamodule.dataset("train")) > 0 and datamodule.vocab_size == 300 and len(calls) == 1
    assert {f.name: f.stat().st_mtime_ns for f in first.iterdir()} == written
    assert hf_datasets(replace(cfg, val_fraction=0.5))["train"].folder == first  # the split is not in the key
    assert len(calls) == 1
    # The tokenizer is keyed by its files' content, not its path.
    shutil.copytree(tok, tmp_path / "tok_copy")
    files = corpus.corpus_files(str(folder))
    assert packed.cache_key(cfg, files, str(tmp_path / "tok_copy")) == packed.cache_key(cfg, files, str(tok))
    (tmp_path / "tok_copy" / "tokenizer_config.json").write_text(
        (tmp_path / "tok_copy" / "tokenizer_config.json").read_text() + "\n"
    )
    assert packed.cache_key(cfg, files, str(tmp_path / "tok_copy")) != packed.cache_key(cfg, files, str(tok))
    # A changed source file, or another seq_len, is another cache.
    (folder / "doc03.txt").write_text(DOCS[3] + " and more")
    changed = hf_datasets(cfg)["train"].folder
    assert changed != first and len(calls) == 2
    assert hf_datasets(replace(cfg, seq_len=8))["train"].folder not in (first, changed) and len(calls) == 3


def test_a_build_that_dies_leaves_no_cache(tmp_path: Path, tok: Path, monkeypatch) -> None:
    cfg = _cfg(_docs(tmp_path / "corpus"), tok, tmp_path / "cache")
    key = packed.cache_key(cfg, corpus.corpus_files(cfg.path), cfg.tokenizer)
    stale = tmp_path / "cache" / f".tmp-{key[:32]}-killed"  # what a killed build leaves: never read
    stale.mkdir(parents=True)
    (stale / "tokens.npy").write_bytes(b"half")

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(packed, "_fill", dies)
        with pytest.raises(KeyboardInterrupt):
            hf_datasets(cfg)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [stale.name]
    assert len(hf_datasets(cfg)["train"]) > 0


def test_tokenizing_in_several_processes_gives_the_same_windows(tmp_path: Path, tok: Path) -> None:
    folder = _docs(tmp_path / "corpus")
    one = hf_datasets(_cfg(folder, tok, tmp_path / "one"))["train"].folder
    two = hf_datasets(_cfg(folder, tok, tmp_path / "two", num_proc=2))["train"].folder
    for name in ("tokens.npy", "windows.npy"):
        np.testing.assert_array_equal(np.load(one / name), np.load(two / name))


def test_a_separate_val_corpus(tmp_path: Path, tok: Path, tokenizer) -> None:
    cfg = _cfg(_docs(tmp_path / "corpus"), tok, tmp_path / "cache", val_path=str(tmp_path / "val.txt"), val_fraction=0)
    (tmp_path / "val.txt").write_text(" ".join(DOCS[:3]))
    data = hf_datasets(cfg)
    assert len(data["train"]) == len(
        _windows([t for d in DOCS for t in [*tokenizer(d)["input_ids"], tokenizer.eos_token_id]])
    )
    assert tokenizer.decode(data["val"][0][0]) == tokenizer.decode(tokenizer(" ".join(DOCS[:3]))["input_ids"][:16])


# ------------------------------------------------------------------------------------------ dealing and resuming
@pytest.fixture
def sft(tmp_path: Path, tok: Path) -> DataConfig:
    path = write_instruction_jsonl(tmp_path / "sft.jsonl", 80)
    return _cfg(path, tok, tmp_path / "cache", format="instruction", global_batch_size=8)


def test_two_dp_ranks_together_read_one_process_batch(sft: DataConfig) -> None:
    datamodule = TokenDataModule(sft, seed=3)
    one = list(datamodule.build_dataloader("train", 1, 0))
    ranks = [list(datamodule.build_dataloader("train", 2, rank)) for rank in range(2)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == len(datamodule.dataset("train")) // 8 > 2
    for k, batch in enumerate(one):
        assert sorted(_rows(ranks[0][k]) + _rows(ranks[1][k])) == sorted(_rows(batch))
        assert (batch[1] == IGNORE_INDEX).any()  # the mask travels with the windows


def test_a_resumed_loader_continues_mid_epoch_exactly(sft: DataConfig) -> None:
    loader = TokenDataModule(sft, seed=3).build_dataloader("train", 2, 1)
    stream = list(loader) + list(loader)  # two epochs
    per_epoch = len(stream) // 2
    for step in (3, per_epoch, per_epoch + 2):
        resumed = TokenDataModule(sft, seed=3)
        resumed.load_state_dict({"global_step": step})
        rest = list(resumed.build_dataloader("train", 2, 1))
        assert len(rest) == per_epoch - step % per_epoch
        for a, b in zip(rest, stream[step:], strict=False):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_gpt_loss_ignores_masked_targets() -> None:
    from lightning_dist.models.module import GPTModule

    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    masked = targets.clone()
    masked[:, :2] = IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[:, 2:].flatten(0, 1), targets[:, 2:].flatten())
    torch.testing.assert_close(GPTModule.loss_fn(logits, masked), expected)


# -------------------------------------------------------------------------------------------------------- errors
def test_errors_name_the_field_the_value_and_the_fix(tmp_path: Path, tok: Path) -> None:
    def fails(match: str, path: Path, **kwargs) -> None:
        with pytest.raises(ValueError, match=match):
            hf_datasets(_cfg(path, tok, tmp_path / "cache", **kwargs))

    fails(r"data.path='.*nowhere' does not exist; pass an existing file", tmp_path / "nowhere")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("# not a corpus")
    fails(r"data.path='.*notes' matched no .txt, .jsonl, .json or .parquet file", tmp_path / "notes")
    path = write_instruction_jsonl(tmp_path / "sft.jsonl", 2)
    path.write_text(path.read_text() + "\n" + json.dumps({"prompt": "where is it?", "answer": "here"}) + "\n")
    fails(
        rf"{path}:4 has no 'response' field \(data.format=instruction reads data.response_field='response'\); add it",
        path,
        format="instruction",
    )
    fails(rf"{path}:1 has no 'question' field", path, format="instruction", prompt_field="question")
    fails(
        r"data.format=instruction reads records but data.path holds .txt files",
        _docs(tmp_path / "c"),
        format="instruction",
    )
    (tmp_path / "short.txt").write_text("document 1")
    fails(
        r"data.path='.*short.txt' holds 6 tokens, fewer than one window of data.seq_len\+1=17; add text",
        tmp_path / "short.txt",
    )
    with pytest.raises(
        ValueError, match=r"data.val_fraction=0 must be in \(0, 1\); pass e.g. .*, or a separate corpus"
    ):
        TokenDataModule(_cfg(tmp_path / "short.txt", tok, tmp_path / "cache", val_fraction=0))
    with pytest.raises(ValueError, match=r"data.format='prose' is unknown; use one of text, instruction, chat"):
        TokenDataModule(_cfg(tmp_path / "short.txt", tok, tmp_path / "cache", format="prose"))
    with pytest.raises(ValueError, match=r"data.tokenizer='.*nowhere' is not a folder"):
        hf_datasets(replace(_cfg(tmp_path / "c", tok, tmp_path / "cache"), tokenizer=str(tmp_path / "nowhere")))


LATIN_1 = "caf\u00e9 au lait".encode("latin-1")
BAD_FILES = {
    "an empty .jsonl": ("c.jsonl", b"", "{file} is empty; remove it from the corpus, or point data.path at files"),
    "an empty .txt": ("c.txt", b"", "{file} is empty"),
    "an empty .parquet": ("c.parquet", b"", "{file} is empty"),
    "a malformed line": ("c.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', r"{file}:3: not valid JSON \(Expecting ','"),
    "a malformed .json": ("c.json", b'[{"text": "a"},\n {"text" "b"}]', r"{file}:2: not valid JSON \(Expecting ':'"),
    "latin-1 text": ("c.txt", LATIN_1, r"{file} is not UTF-8 text \(byte 0xe9 at offset 3\)"),
}
GOOD = {".jsonl": b'{"text": "fine"}\n', ".json": b'[{"text": "fine"}]', ".txt": b"fine", ".parquet": None}


@pytest.mark.parametrize("case", BAD_FILES, ids=str)
def test_a_bad_file_is_one_line_naming_it_and_where(case: str, tmp_path: Path, tok: Path) -> None:
    """Among good files of its kind; 1-based line numbers, as an editor shows them (the datasets library's are
    0-based rows, without the file)."""
    name, content, message = BAD_FILES[case]
    file = tmp_path / "corpus" / name
    file.parent.mkdir()
    file.write_bytes(content)
    if GOOD[file.suffix] is not None:
        (tmp_path / "corpus" / f"a{file.suffix}").write_bytes(GOOD[file.suffix])
    with pytest.raises(ValueError, match="^data.path: " + message.format(file=file)):
        hf_datasets(_cfg(tmp_path / "corpus", tok, tmp_path / "cache"))


def _app(tmp_path: Path, *overrides: str) -> list[str]:
    folder = tmp_path / "corpus" if (tmp_path / "corpus").exists() else _docs(tmp_path / "corpus")
    return ["logger=none", "data=hf", f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}",
            "data.seq_len=16", "data.global_batch_size=4", "data.num_proc=1", *overrides]  # fmt: skip


def test_the_app_tokenizes_before_launch_and_checks_the_vocabulary(tmp_path: Path, tok: Path, monkeypatch) -> None:
    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=r"has 300 tokens, more than the model's vocabulary of 256; use the model's"):
        validate(compose_config(_app(tmp_path, f"data.tokenizer={tok}")))  # gpt_tiny: 256
    with pytest.raises(ValueError, match=r"data.tokenizer=null and the model has no folder with a tokenizer"):
        validate(compose_config(_app(tmp_path, "model.vocab_size=512")))
    calls = []
    tokenize = corpus.tokenize
    monkeypatch.setattr(corpus, "tokenize", lambda *args, **kwargs: calls.append(1) or tokenize(*args, **kwargs))
    run = validate(compose_config(_app(tmp_path, f"data.tokenizer={tok}", "model.vocab_size=512")))
    assert len(calls) == 1 and run.cfg.data.kind == "hf"
    rank = TokenDataModule(run.cfg.data, seed=run.cfg.seed)  # what each rank builds: the cache is there
    rank.prepare_data()
    assert len(rank.dataset("train")) > 0 and len(calls) == 1


def test_data_tokenizer_defaults_to_the_pretrained_folder(tmp_path: Path, tok: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_dist.config.validate import validate

    model = tmp_path / "model"
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model)
    shutil.copytree(tok, model, dirs_exist_ok=True)
    run = validate(compose_config(_app(tmp_path, "model=hf", f"model.pretrained={model}")))
    assert Path(run.cfg.data.tokenizer).resolve() == model.resolve()
