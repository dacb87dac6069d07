"""data=hf, reading and tokenizing: your files, read with the datasets library, tokenized with the model's tokenizer.

The files (``.txt``, ``.jsonl`` / ``.json`` or ``.parquet``, one kind per corpus) are read in sorted-path order and
tokenized by ``datasets.map`` in ``data.num_proc`` processes, which keeps the order, so the same files always give the
same tokens. Each document or record becomes one token sequence ended by the tokenizer's EOS:

- ``format=text``: ``tokenizer(text)`` (with the special tokens the tokenizer adds itself, e.g. Llama's BOS), EOS;
- ``format=instruction``: [BOS], prompt, response, EOS; the loss is on the response and the EOS only;
- ``format=chat``: the conversation as the tokenizer's chat template renders it (without a template: one
  ``role: content`` line per message, after a BOS), EOS; the loss is on the assistant messages (with the template's
  end-of-turn tokens) and the EOS after the last one.

Each piece (prompt, response, the template's text between messages) is tokenized on its own, so where the loss starts
and stops is exact. :mod:`lightning_dist.data.packed` packs the sequences into windows and caches them.
"""

from __future__ import annotations

import codecs
import functools
import glob
import json
import os
from pathlib import Path
from typing import Any

from lightning_dist.errors import first_line

#: File suffix -> the datasets library's loader for it.
SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: The files of a tokenizer folder (what the cache key hashes; a model folder's weights are not read).
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")
_GLOB_CHARS = ("*", "?", "[")
_INSTALL = "pip install 'lightning-dist[hf]'"


def corpus_files(path: str, where: str = "data.path") -> list[Path]:
    """The files of a corpus, sorted by path: ``path`` is a file, a directory (searched recursively, hidden folders
    skipped) or a glob; ``where`` names the config field in errors."""
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and f.suffix.lower() in SUFFIXES
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
    elif any(c in path for c in _GLOB_CHARS):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    else:
        raise ValueError(f"{where}={path!r} does not exist; pass an existing file, directory or glob of your text")
    if not files:
        raise ValueError(
            f"{where}={path!r} matched no .txt, .jsonl, .json or .parquet file; point it at your text (a glob such as "
            "'corpus/**/*.jsonl' picks files)"
        )
    unknown = [f for f in files if f.suffix.lower() not in SUFFIXES]
    if unknown:
        raise ValueError(
            f"{where}={path!r} matched {str(unknown[0])!r}, which is not .txt, .jsonl, .json or .parquet; narrow it "
            "with a glob such as 'corpus/**/*.jsonl'"
        )
    kinds = sorted({f.suffix.lower() for f in files})
    if len({SUFFIXES[kind] for kind in kinds}) > 1:
        raise ValueError(
            f"{where}={path!r} matched files of several kinds ({', '.join(kinds)}); point it at one kind, e.g. a glob "
            "such as 'corpus/**/*.jsonl'"
        )
    return files


def tokenizer_files(folder: str) -> list[Path]:
    """The tokenizer's files in ``folder`` (``data.tokenizer``), sorted by name."""
    d = Path(folder).expanduser()
    if not d.is_dir():
        raise ValueError(
            f"data.tokenizer={folder!r} is not a folder; give a local folder holding the tokenizer's files "
            "(tokenizer.json, tokenizer_config.json, ...): nothing is downloaded"
        )
    files = _tokenizer_files(d)
    if not files:
        raise ValueError(
            f"data.tokenizer={folder!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...); give "
            "the folder a tokenizer was saved to with save_pretrained"
        )
    return files


def holds_tokenizer(folder: str | None) -> bool:
    """Whether ``folder`` is a local folder with tokenizer files (a default for ``data.tokenizer``)."""
    return bool(folder) and Path(folder).expanduser().is_dir() and bool(_tokenizer_files(Path(folder).expanduser()))


def _tokenizer_files(d: Path) -> list[Path]:
    return sorted(
        f
        for f in d.iterdir()
        if f.is_file() and (f.name.startswith(TOKENIZER_PREFIXES) or f.suffix in TOKENIZER_SUFFIXES)
    )


@functools.lru_cache(maxsize=4)
def load_tokenizer(folder: str) -> Any:
    """The tokenizer of ``folder`` (``AutoTokenizer``, local files only), loaded once per process."""
    tokenizer_files(folder)
    try:
        from transformers import AutoTokenizer  # optional dependency: lightning-dist[hf]
    except ImportError:
        raise ValueError(f"data=hf needs transformers and datasets; {_INSTALL}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"data.tokenizer={folder!r} cannot be loaded ({str(err).splitlines()[0]}); give a folder a tokenizer was "
            "saved to with save_pretrained"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"data.tokenizer={folder!r} has no EOS token, which ends every packed document; set eos_token in its "
            "tokenizer_config.json"
        )
    return tokenizer


def record_fields(cfg: Any) -> dict[str, str]:
    """The record fields ``cfg.format`` reads: config field -> the name in the records."""
    if cfg.format == "instruction":
        return {"data.prompt_field": cfg.prompt_field, "data.response_field": cfg.response_field}
    if cfg.format == "chat":
        return {"data.messages_field": cfg.messages_field}
    return {"data.text_field": cfg.text_field}


def load_records(files: list[Path], cfg: Any, work_dir: Path, where: str) -> Any:
    """The records of ``files`` as a ``datasets.Dataset`` (its Arrow files under ``work_dir``), fields checked."""
    try:
        import datasets  # optional dependency: lightning-dist[hf]
    except ImportError:
        raise ValueError(f"data=hf needs datasets and transformers; {_INSTALL}") from None
    loader = SUFFIXES[files[0].suffix.lower()]
    if loader == "text" and cfg.format != "text":
        raise ValueError(
            f"data.format={cfg.format} reads records but {where} holds .txt files; use data.format=text, or give "
            ".jsonl / .json / .parquet records"
        )
    empty = next((f for f in files if f.stat().st_size == 0), None)
    if empty is not None:
        raise ValueError(f"{where}: {empty} is empty; remove it from the corpus, or point {where} at files with text")
    kwargs = {"sample_by": cfg.sample_by} if loader == "text" else {}
    try:
        records = datasets.load_dataset(
            loader, data_files=[str(f) for f in files], split="train", cache_dir=str(work_dir), **kwargs
        )
    except Exception as err:  # the datasets library wraps the parser's error: find the file and line ourselves
        cause = err.__cause__ or err
        found = next((problem for f in files if (problem := _unreadable(f, loader))), None)
        raise ValueError(
            f"{where}: {found}"
            if found
            else f"{where}: the {loader} files cannot be read "
            f"({type(cause).__name__}: {first_line(cause)}); check the files"
        ) from None
    if loader != "text":
        _check_fields(records, files, cfg, work_dir)
    return records


def _unreadable(file: Path, loader: str) -> str | None:
    """What makes ``file`` unreadable, naming where: bytes that are not UTF-8, or (JSON) the first line, 1-based, that
    is not valid JSON; ``None`` if neither (a parquet file, or a problem of another kind)."""
    if loader == "parquet":
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with file.open("rb") as handle:
        while chunk := handle.read(1 << 23):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:  # err.object: the bytes held back from the chunk before, then this one
                byte, where = err.object[err.start], offset + err.start - (len(err.object) - len(chunk))
                return f"{file} is not UTF-8 text (byte 0x{byte:02x} at offset {where}); convert it to UTF-8"
            offset += len(chunk)
    if loader != "json":
        return None
    text = file.read_text(encoding="utf-8")
    lines = [text] if text.lstrip().startswith("[") else text.splitlines()  # one array, or JSON lines
    for number, line in enumerate(lines, start=1):
        try:
            if line.strip():
                json.loads(line)
        except json.JSONDecodeError as err:
            line_number = err.lineno if len(lines) == 1 else number
            return f"{file}:{line_number}: not valid JSON ({err.msg}, column {err.colno}); fix or remove that line"
    return None


def _check_fields(records: Any, files: list[Path], cfg: Any, work_dir: Path) -> None:
    for option, name in record_fields(cfg).items():
        column = records.data.column(name) if name in records.column_names else None
        if column is None or column.null_count:
            raise ValueError(
                f"{_first_missing(files, name, work_dir)} has no {name!r} field (data.format={cfg.format} reads "
                f"{option}={name!r}); add it to every record or set {option} to the records' field"
            )
        kind = column.type
        if cfg.format == "chat":
            item = getattr(kind, "value_type", None)
            if item is None or not all(item.get_field_index(key) >= 0 for key in ("role", "content")):
                raise ValueError(
                    f"{option}={name!r} holds {kind}, not a list of {{role, content}} messages; point it at the "
                    "records' conversation"
                )
        elif str(kind) not in ("string", "large_string"):
            raise ValueError(f"{option}={name!r} holds {kind} values, not text; point it at a text field")


def _first_missing(files: list[Path], name: str, work_dir: Path) -> str:
    """Where the first record without ``name`` is: ``file:line`` (JSON lines), ``file record N`` or ``file row N``."""
    import datasets  # optional dependency: lightning-dist[hf]

    for file in files:
        if file.suffix.lower() == ".parquet":
            table = datasets.load_dataset("parquet", data_files=[str(file)], split="train", cache_dir=str(work_dir))
            if name not in table.column_names:
                return f"{file} row 1"
            nulls = table.data.column(name).is_null().to_numpy(zero_copy_only=False)
            if nulls.any():
                return f"{file} row {int(nulls.argmax()) + 1}"
            continue
        text = file.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):  # one JSON array of records
            for number, record in enumerate(json.loads(text), start=1):
                if not isinstance(record, dict) or record.get(name) is None:
                    return f"{file} record {number}"
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            record = json.loads(line) if line.strip() else {name: ""}
            if not isinstance(record, dict) or record.get(name) is None:
                return f"{file}:{number}"
    return str(files[0])


def tokenize(records: Any, tokenizer: Any, cfg: Any, fingerprint: str) -> Any:
    """``records`` tokenized in ``data.num_proc`` processes (datasets' progress bar): columns ``ids`` (and ``mask``:
    1 where the token is a target of the loss, for instruction and chat)."""
    import datasets  # optional dependency: lightning-dist[hf]

    num_proc = min(cfg.num_proc or min(8, os.cpu_count() or 1), max(1, len(records)))
    sequence = getattr(datasets, "List", None) or datasets.Sequence  # List since datasets 4
    columns = {"ids": sequence(datasets.Value("int32"))}
    if cfg.format != "text":
        columns["mask"] = sequence(datasets.Value("int8"))
    return records.map(
        Tokenize(tokenizer, cfg, in_workers=num_proc > 1),
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=records.column_names,
        features=datasets.Features(columns),
        new_fingerprint=fingerprint,
        desc="tokenizing",
    )


class Tokenize:
    """The batched map function: records -> ``{"ids": [...]}`` (and ``"mask"`` for instruction / chat)."""

    def __init__(self, tokenizer: Any, cfg: Any, in_workers: bool = False) -> None:
        self.tokenizer = tokenizer
        self.in_workers = in_workers
        self.format = cfg.format
        self.fields = record_fields(cfg)
        self.eos = int(tokenizer.eos_token_id)
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [bos]
        self.bos = [int(bos)] if adds_bos and tokenizer("x", add_special_tokens=False)["input_ids"][:1] != [bos] else []
        self.template = cfg.format == "chat" and getattr(tokenizer, "chat_template", None) is not None
        self.tokenizer_name = str(getattr(tokenizer, "name_or_path", ""))

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        if self.in_workers:  # one thread per worker process: the processes are the parallelism (no oversubscription)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if self.format == "text":
            texts = batch[self.fields["data.text_field"]]
            encoded = self.tokenizer(texts, verbose=False)["input_ids"]
            return {"ids": [self._ended(ids) if text.strip() else [] for ids, text in zip(encoded, texts)]}
        if self.format == "instruction":
            prompts, responses = (batch[name] for name in self.fields.values())
            segments = [[(p, False), (r, True)] for p, r in zip(prompts, responses)]
        else:
            segments = [self._chat(messages) for messages in batch[self.fields["data.messages_field"]]]
        pieces = [text for record in segments for text, _ in record]
        encoded = iter(self.tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"] if pieces else [])
        out: dict[str, list[list[int]]] = {"ids": [], "mask": []}
        for record in segments:
            prefix = [] if self.template else self.bos
            ids, mask = list(prefix), [0] * len(prefix)
            for _, supervised in record:
                piece = next(encoded)
                ids += piece
                mask += [int(supervised)] * len(piece)
            ids.append(self.eos)
            mask.append(int(bool(record) and record[-1][1]))  # the EOS is a target after a response
            out["ids"].append(ids)
            out["mask"].append(mask)
        return out

    def _ended(self, ids: list[int]) -> list[int]:
        return ids if ids[-1:] == [self.eos] else [*ids, self.eos]

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja's own errors, and the template's raise_exception(...)
            raise ValueError(
                f"the chat template of data.tokenizer={self.tokenizer_name!r} cannot render a conversation "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); fix the records or use "
                "data.format=instruction"
            ) from None

    def _chat(self, messages: list[dict[str, Any]]) -> list[tuple[str, bool]]:
        """The conversation as (text, is a target) pieces: the assistant messages are targets."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if not self.template:
            pieces: list[tuple[str, bool]] = []
            for m in messages:
                role, content = m.get("role"), f"{m.get('content', '')}\n"
                assistant = role == "assistant"
                pieces += [(f"{role}: ", False), (content, True)] if assistant else [(f"{role}: {content}", False)]
            return pieces
        pieces, done = [], ""
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prompt, full = self._render(messages[:i], generation_prompt=True), self._render(messages[: i + 1])
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise ValueError(
                    f"the chat template of data.tokenizer={self.tokenizer_name!r} does not render a conversation "
                    "turn by turn (a turn changes the text before it); use data.format=instruction"
                )
            pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            done = full
        whole = self._render(messages)
        if whole.startswith(done) and len(whole) > len(done):
            pieces.append((whole[len(done) :], False))  # messages after the last assistant one
        return pieces
