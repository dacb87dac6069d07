"""Structured config for the data pipeline, and the rules that need only the config (checked before launch).

Plain Python: the launcher of ``lightning-dist-train`` checks a data config, its per-rank batch and its seed without
the data module's torch and Lightning (:mod:`lightning_dist.data.datamodule` applies the same rules on a rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dist.data.sources import parse_source
from lightning_dist.hub import split_source

KINDS = ("synthetic", "text", "tokens", "hf")
TOKEN_DTYPES = ("uint16", "uint32")
#: data=hf: documents (text), prompt / response records (instruction), or conversations (chat).
HF_FORMATS = ("text", "instruction", "chat")
#: data=hf, .txt files: what one document is (the ``sample_by`` of the datasets library's text loader).
SAMPLE_BY = ("document", "paragraph", "line")


@dataclass
class DataConfig:
    """Hydra structured config selecting and sizing the training data."""

    kind: str = "synthetic"
    """Data source: "synthetic" (seeded Markov chain), "text" (byte-level files), "tokens" (nanoGPT .bin) or "hf"
    (your text with the model's tokenizer, packed and cached)."""
    global_batch_size: int = 32
    """Samples per optimizer step summed over all data-parallel ranks; the per-rank batch is derived."""
    micro_batch_size: int | None = None
    """Samples per forward per data-parallel rank; None = the whole per-rank batch. Smaller: the per-rank batch is
    accumulated over per_rank / micro forwards (gradients synced once per step); under pp it is the size of the
    pipeline's microbatches."""
    seq_len: int = 128
    """Tokens per sample fed to the model; each sample holds seq_len+1 tokens, inputs = [:-1], targets = [1:]."""
    vocab_size: int = 256
    """synthetic: alphabet size; text: ignored (fixed 256 byte-level); tokens: vocabulary of the .bin files; hf:
    ignored (the tokenizer's)."""
    path: Any = None
    """text: a file, a directory or a glob; tokens: a directory holding train.bin and val.bin; hf: a file, a directory
    or a glob of .txt, .jsonl / .json or .parquet files (one kind), or a hub dataset id (downloaded; with
    data.streaming=true streamed from the hub, hf://datasets/<id>[@<rev>]); with data.streaming=true also a list of
    them, a weighted mixture of sources (data.weights)."""
    val_fraction: float = 0.1
    """text: fraction of the concatenated bytes, taken at the tail, used for validation; hf: fraction of the windows,
    taken at the tail (ignored with data.val_path)."""
    token_dtype: str = "uint16"
    """tokens: element type of the .bin files, uint16 or uint32."""
    branching: int = 4
    """synthetic: number of distinct successors per token in the Markov chain."""
    num_train_samples: int = 16384
    """synthetic: number of training samples."""
    num_val_samples: int = 512
    """synthetic: number of validation samples."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    seed: int | None = None
    """Seed for data generation and shuffling; None = the run's seed."""
    tokenizer: str | None = None
    """hf: a local folder with the tokenizer's files; None = the model's own folder (model.pretrained, init_from or a
    model.config folder, whichever holds a tokenizer)."""
    format: str = "text"
    """hf: text (documents), instruction (prompt / response records) or chat (a messages list, rendered with the
    tokenizer's chat template when it has one); instruction and chat train on the response tokens only."""
    text_field: str = "text"
    """hf, format=text: the field of a .jsonl / .json / .parquet record that holds the document."""
    prompt_field: str = "prompt"
    """hf, format=instruction: the record's prompt field (no loss on its tokens)."""
    response_field: str = "response"
    """hf, format=instruction: the record's response field (the loss is on its tokens and the EOS after it)."""
    messages_field: str = "messages"
    """hf, format=chat: the record's list of {role, content}; the loss is on the assistant messages."""
    sample_by: str = "document"
    """hf, .txt files: one document per file (document), per blank-line-separated paragraph, or per line."""
    val_path: str | None = None
    """hf: a separate validation corpus (file, directory or glob); None = the last data.val_fraction of the windows."""
    cache_dir: str | None = None
    """hf: where the tokenized, packed windows are cached; None = $XDG_CACHE_HOME/lightning_dist/data
    (~/.cache/lightning_dist/data). Multi-node: a folder every node sees."""
    num_proc: int | None = None
    """hf: processes that tokenize (datasets' map); None = min(8, CPU count)."""
    streaming: bool = False
    """hf, format=text: read the train corpus as it is needed, tokenized and packed on the fly, nothing cached (a
    corpus larger than disk; a hub dataset is streamed, not downloaded); past its end it starts another pass, so the
    run ends at trainer.max_steps. The position in the stream is checkpointed, so a resume continues it exactly, under
    any data-parallel size. Validation reads data.val_path (cached as usual); without it validation is off."""
    weights: list[float] | None = None
    """hf, data.streaming=true with a list data.path: each source's share of the windows, so of the tokens
    (normalized; blended by index: among any first n windows a source is under one window from its share); None =
    equal shares."""
    num_streams: int = 1
    """hf, data.streaming=true: the streams the sources' shards (files) are dealt to; window g comes from stream
    g mod num_streams, and a data-parallel rank reads only the streams of its windows. 1: every rank reads the whole
    corpus. A multiple of the data-parallel size: each rank reads only its own shards (give each source a multiple of
    num_streams files). The batches depend on it, not on the data-parallel size; a resume keeps it."""


def validate_data_config(cfg: Any) -> None:
    """Checks field values of a DataConfig (or an equivalent DictConfig).

    Args:
        cfg: The data config.

    Raises:
        ValueError: If a field holds an unsupported value.
    """
    if cfg.kind not in KINDS:
        raise ValueError(f"data.kind={cfg.kind!r} is unknown; use one of {', '.join(KINDS)}")
    if cfg.global_batch_size < 1:
        raise ValueError(f"data.global_batch_size={cfg.global_batch_size} must be >= 1; pass a positive batch size")
    micro = getattr(cfg, "micro_batch_size", None)
    if micro is not None and micro < 1:
        raise ValueError(f"data.micro_batch_size={micro} must be >= 1, or null for the whole per-rank batch")
    if cfg.seq_len < 1:
        raise ValueError(f"data.seq_len={cfg.seq_len} must be >= 1; pass a positive sequence length")
    if cfg.num_workers < 0:
        raise ValueError(f"data.num_workers={cfg.num_workers} must be >= 0; pass 0 to load in the main process")
    if getattr(cfg, "num_streams", 1) < 1:
        raise ValueError(f"data.num_streams={cfg.num_streams} must be >= 1; pass 1 for one stream every rank reads")
    if getattr(cfg, "num_streams", 1) > 1 and not (cfg.kind == "hf" and getattr(cfg, "streaming", False)):
        raise ValueError(
            f"data.num_streams={cfg.num_streams} deals a streamed corpus to streams; set data=hf data.streaming=true, "
            "or data.num_streams=1"
        )
    if cfg.kind != "hf" and getattr(cfg, "streaming", False):
        raise ValueError(f"data.streaming=true reads data=hf corpora; data.kind={cfg.kind}: set data.streaming=false")
    if cfg.kind != "hf" and not (cfg.path is None or isinstance(cfg.path, str)):
        raise ValueError(
            f"data.path={_shown(cfg.path)} is a list; data.kind={cfg.kind} reads one path (a mixture of sources is "
            "data=hf data.streaming=true)"
        )
    if cfg.kind == "synthetic":
        if cfg.vocab_size < 2:
            raise ValueError(f"data.vocab_size={cfg.vocab_size} must be >= 2 for synthetic data; pass a larger vocab")
        if not 1 <= cfg.branching <= cfg.vocab_size:
            raise ValueError(
                f"data.branching={cfg.branching} must be in [1, data.vocab_size={cfg.vocab_size}]; lower data.branching"
            )
        if cfg.num_train_samples < 1 or cfg.num_val_samples < 1:
            raise ValueError(
                f"data.num_train_samples={cfg.num_train_samples} and data.num_val_samples={cfg.num_val_samples} "
                "must be >= 1; pass positive sizes"
            )
    if cfg.kind == "hf":
        _validate_hf(cfg)
    if cfg.kind == "text" and not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} must be in (0, 1); pass e.g. data.val_fraction=0.1")
    if cfg.kind == "tokens":
        if cfg.token_dtype not in TOKEN_DTYPES:
            raise ValueError(
                f"data.token_dtype={cfg.token_dtype!r} is unsupported; use one of {', '.join(TOKEN_DTYPES)}"
            )
        if cfg.vocab_size < 1:
            raise ValueError(f"data.vocab_size={cfg.vocab_size} must be >= 1; pass the tokenizer's vocabulary size")


def per_rank_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Derives the per-rank batch size.

    Args:
        global_batch_size: Samples per optimizer step over all data-parallel ranks.
        num_replicas: Data-parallel world size.

    Returns:
        ``global_batch_size // num_replicas``.

    Raises:
        ValueError: If ``global_batch_size`` is not a positive multiple of ``num_replicas``.
    """
    if num_replicas < 1:
        raise ValueError(f"data-parallel size {num_replicas} must be >= 1; check the strategy's parallel sizes")
    if global_batch_size < 1:
        raise ValueError(f"data.global_batch_size={global_batch_size} must be >= 1; pass a positive batch size")
    if global_batch_size < num_replicas or global_batch_size % num_replicas:
        raise ValueError(
            f"data.global_batch_size={global_batch_size} is not divisible by the data-parallel size "
            f"{num_replicas}; set data.global_batch_size to a multiple of {num_replicas}"
        )
    return global_batch_size // num_replicas


def data_seed(cfg: Any, seed: int) -> int:
    """The seed of data generation and shuffling: ``cfg.seed``, else the run's ``seed``.

    Raises:
        ValueError: If it is negative.
    """
    value = int(cfg.seed if cfg.seed is not None else seed)
    if value < 0:
        raise ValueError(f"data seed {value} must be >= 0; pass a non-negative seed (data.seed=...)")
    return value


def _validate_hf(cfg: Any) -> None:
    """data=hf's own fields (the files and the tokenizer are checked when the cache is built)."""
    if cfg.path is None:
        raise ValueError(
            "data.path=null but data=hf needs it; pass a file, directory or glob of .txt / .jsonl / .json / .parquet "
            "files (data.path=...)"
        )
    if cfg.format not in HF_FORMATS:
        raise ValueError(f"data.format={cfg.format!r} is unknown; use one of {', '.join(HF_FORMATS)}")
    if cfg.sample_by not in SAMPLE_BY:
        raise ValueError(f"data.sample_by={cfg.sample_by!r} is unknown; use one of {', '.join(SAMPLE_BY)}")
    if cfg.num_proc is not None and cfg.num_proc < 1:
        raise ValueError(f"data.num_proc={cfg.num_proc} must be >= 1, or null for min(8, CPU count)")
    if getattr(cfg, "streaming", False):
        _validate_streaming(cfg)
        return
    if not isinstance(cfg.path, str):
        raise ValueError(
            f"data.path={_shown(cfg.path)} is a list, a mixture of sources, which only data.streaming=true reads; "
            "set data.streaming=true, or prepare a mixture with lightning-dist-prepare --weights"
        )
    for field in ("path", "val_path"):
        value = getattr(cfg, field, None)
        if isinstance(value, str) and split_source(value)[1]:
            raise ValueError(
                f"data.{field}={value}: a source's options ({split_source(value)[1]}) are read by data.streaming=true "
                "(train) and lightning-dist-prepare; set data.streaming=true, or prepare it once with "
                "lightning-dist-prepare"
            )
    if getattr(cfg, "weights", None) is not None:
        raise ValueError(
            f"data.weights={_shown(cfg.weights)} weighs a mixture, which only data.streaming=true reads; set "
            "data.streaming=true with a list data.path, or drop data.weights"
        )
    if cfg.val_path is None and not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(
            f"data.val_fraction={cfg.val_fraction} must be in (0, 1); pass e.g. data.val_fraction=0.05, or a separate "
            "corpus as data.val_path"
        )


def sources(cfg: Any) -> list[str]:
    """``data.path`` as a list of sources (one path or hub id, or a list of them)."""
    return [cfg.path] if isinstance(cfg.path, str) else [str(p) for p in cfg.path]


def _shown(value: Any) -> str:
    return str(list(value)) if not isinstance(value, str) else value


def _validate_streaming(cfg: Any) -> None:
    """data=hf data.streaming=true: text documents read in the main process, a mixture weighted one per source."""
    paths = cfg.path if isinstance(cfg.path, str) else list(cfg.path)
    if not paths or not all(isinstance(p, str) and p for p in sources(cfg)):
        raise ValueError(f"data.path={_shown(cfg.path)}: give a path or hub id, or a non-empty list of them")
    if cfg.format != "text":
        raise ValueError(
            f"data.streaming=true reads data.format=text documents; data.format={cfg.format} is cached only: set "
            "data.streaming=false"
        )
    if cfg.num_workers != 0:
        raise ValueError(
            f"data.num_workers={cfg.num_workers} with data.streaming=true: the stream's position lives in the main "
            "process; set data.num_workers=0"
        )
    for path in sources(cfg):
        if parse_source(path, "data.path").max_tokens is not None:
            raise ValueError(
                f"data.path={path}: max_tokens caps a source lightning-dist-prepare writes; a stream's share of each "
                "source is data.weights: drop max_tokens"
            )
    weights = cfg.weights
    if weights is not None and (len(weights) != len(sources(cfg)) or any(w <= 0 for w in weights)):
        raise ValueError(
            f"data.weights={_shown(weights)}: give one positive weight per source of data.path "
            f"({len(sources(cfg))} sources)"
        )
