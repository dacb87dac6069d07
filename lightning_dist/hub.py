"""Hub ids into local folders: ``model.pretrained=<org/name>`` and ``data.path=<org/name>`` (a dataset repo).

A hub id is looked up in the local HuggingFace cache first (no network). One not there is downloaded with
``huggingface_hub.snapshot_download`` into that cache, the files a run reads only (safetensors, configs, tokenizer;
a dataset's data files), by **one process per node**: local rank 0 (``LOCAL_RANK`` / ``SLURM_LOCALID``, unset = 0: the
app's launcher resolves the config once per node) downloads and then writes a marker; the node's other processes wait
for the marker and read the same files. The token is huggingface_hub's own (``HF_TOKEN``, or ``hf auth login``'s);
``HF_ENDPOINT`` names another hub; ``HF_HUB_OFFLINE=1`` downloads nothing (a miss is one line, as before).

``data.streaming=true`` downloads no train source: a hub dataset id not cached is streamed by each rank
(:func:`hub_stream`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

#: data.streaming=true: a train source streamed from the hub, ``hf://datasets/<org/name>[@<revision>]`` (a hub id not
#: cached becomes one before launch: :func:`hub_stream`).
HUB_STREAM = "hf://datasets/"
#: A source's options, after its location: ``LOCATION?name=<config>&split=<split>&data_files=<glob>&max_tokens=<n>``
#: (:mod:`lightning_dist.data.sources` reads them).
SOURCE_OPTIONS = ("name", "split", "data_files", "max_tokens")
_OPTIONS_START = re.compile(r"\?[A-Za-z_]+=")  # a glob's ? is never followed by a name and =
#: What a run reads from a model repo (not ``*.bin`` / ``*.pth`` / ``original/``: the safetensors are read).
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
#: A dataset repo's data files that ``data=hf`` reads, with its README (dataset card) and configs.
DATA_FILES = ("*.jsonl", "*.json", "*.parquet", "*.txt", "*.md", "*.yaml", "*.jsonl.gz", "*.json.gz")
#: How long a node's other processes wait for local rank 0's download (``LIGHTNING_DIST_HUB_WAIT_S``).
WAIT_S = 6 * 3600.0


def hub_cache_dir() -> Path:
    """The HuggingFace hub cache as the environment names it now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's order, read at call
    time rather than when it was imported)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set (read now): nothing is downloaded."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, ``SLURM_LOCALID``); 0 when neither is set."""
    return int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)


def hub_snapshot(field: str, name: str, kind: str = "model") -> Path:
    """The local snapshot folder of the hub repo ``name`` (``org/name`` or ``org/name@<revision>``): cached, or
    downloaded by one process per node (module docstring).

    Args:
        field: The config field that named it, for the error (``model.pretrained``).
        name: The hub id.
        kind: ``model`` or ``dataset``.

    Raises:
        ValueError: huggingface_hub missing; not cached while offline; not on the hub or not reachable; a node's
            download not done in time (one line each).
    """
    huggingface_hub = _huggingface_hub(field, name)
    snapshot_download = huggingface_hub.snapshot_download
    repo_id, _, revision = name.partition("@")
    cache, patterns = hub_cache_dir(), list(MODEL_FILES if kind == "model" else DATA_FILES)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    errors = (OSError, ValueError, huggingface_hub.errors.HfHubHTTPError)

    def cached() -> Path | None:
        try:
            return Path(
                snapshot_download(
                    repo_id,
                    repo_type=kind,
                    revision=revision or None,
                    cache_dir=cache,
                    allow_patterns=patterns,
                    local_files_only=True,
                )
            )
        except errors:  # not cached (LocalEntryNotFoundError), or not a valid hub id (HFValidationError)
            return None

    found = cached()
    if found is not None:
        return found
    if offline():
        raise ValueError(
            f"{field}={name} is neither a local folder nor in the HuggingFace cache ({cache}), and HF_HUB_OFFLINE is "
            f"set: nothing is downloaded; unset it to download, or fetch it where the network is reachable (hf "
            f"download {repo_id}{' --repo-type dataset' if kind == 'dataset' else ''}) into this cache."
        )
    marker = cache / ".lightning-dist" / f"{kind}--{repo_id.replace('/', '--')}@{revision or 'main'}.done"
    if local_rank() != 0:
        return _wait_for(marker, cached, field, name)
    started = time.monotonic()
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                repo_type=kind,
                revision=revision or None,
                cache_dir=cache,
                allow_patterns=patterns,
                endpoint=endpoint,
            )
        )
    except errors as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{field}={name}: downloading it from the hub failed ({reason}); check the id and your access (HF_TOKEN "
            "or `hf auth login` for a gated repo), or give a local folder."
        ) from None
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{folder}\n{time.monotonic() - started:.1f} s\n")
    return folder


def _wait_for(marker: Path, cached: object, field: str, name: str) -> Path:
    """A node's other process: wait until local rank 0's download is done (its marker, written after this process
    started), then read the cached snapshot."""
    started = time.time()
    limit = float(os.environ.get("LIGHTNING_DIST_HUB_WAIT_S", WAIT_S))
    while time.time() - started < limit:
        if marker.is_file() and marker.stat().st_mtime >= started - 5:
            found = cached()  # type: ignore[operator]
            if found is not None:
                return found
        time.sleep(0.5)
    raise ValueError(
        f"{field}={name}: local rank 0 did not finish downloading it within {limit:.0f} s "
        "(LIGHTNING_DIST_HUB_WAIT_S); download it into the cache first (hf download ...)."
    )


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` (not on this machine) reads as a hub id: ``org/name`` or ``org/name@<revision>``, no glob."""
    repo = path.partition("@")[0]
    org, _, name = repo.partition("/")
    return (
        repo.count("/") == 1
        and bool(org and name)
        and not any(c in repo for c in "*?[]~")
        and not repo.startswith((".", "/"))
    )


def resolve_data_path(data: object) -> None:
    """``data=hf``: a ``data.path`` / ``data.val_path`` that is a hub dataset id, not a local path, becomes the local
    snapshot of its data files (:func:`hub_snapshot`), which ``data=hf`` then reads as a folder; each source of a
    mixture (a list ``data.path``) alike. With ``data.streaming=true`` a train source is not downloaded: it becomes
    ``hf://datasets/<id>@<commit>`` (:func:`hub_stream`), which every rank streams from the hub. In place."""
    if getattr(data, "kind", None) != "hf":
        return
    streaming = bool(getattr(data, "streaming", False))

    def local(field: str, value: str) -> str:
        location, options = split_source(value)
        if options:  # a part of a hub dataset (a config, split, files): streamed at a pinned commit, or refused later
            if streaming and field == "path" and looks_like_hub_id(location):
                return f"{hub_stream(f'data.{field}', location, pinned=True)}?{options}"
            return value
        if value and not Path(value).expanduser().exists() and looks_like_hub_id(value):
            if streaming and field == "path":  # the train stream; data.val_path is cached, so downloaded
                return hub_stream(f"data.{field}", value)
            return str(hub_snapshot(f"data.{field}", value, kind="dataset"))
        return value

    for field in ("path", "val_path"):
        value = getattr(data, field, None)
        if isinstance(value, str) or value is None:
            setattr(data, field, local(field, value) if value else value)
        else:  # data.streaming=true: a mixture, a list of sources
            setattr(data, field, [local(field, str(v)) for v in value])


def split_source(source: str) -> tuple[str, str]:
    """``(location, options)`` of a source written ``LOCATION[?key=value&...]`` (keys: :data:`SOURCE_OPTIONS`);
    ``options`` is ``""`` without any. A ``?`` not followed by ``<name>=`` belongs to the location (a glob's
    wildcard)."""
    found = _OPTIONS_START.search(source)
    return (source, "") if found is None else (source[: found.start()], source[found.start() + 1 :])


def hub_stream(field: str, name: str, pinned: bool = False) -> str:
    """What ``data.streaming=true`` reads of the hub dataset ``name`` (``org/name[@revision]``): its snapshot folder
    when it is in the HuggingFace cache already (read from disk, no network; not with ``pinned``: a source that names
    a part of the dataset is always streamed), else ``hf://datasets/<id>@<commit>``, streamed by each rank
    (``datasets.load_dataset(<id>, streaming=True)``: HTTP range reads, nothing downloaded whole) at the commit the
    revision names now, so every rank reads the same files.

    Raises:
        ValueError: huggingface_hub missing; not cached while ``HF_HUB_OFFLINE`` is set; not on the hub or not
            reachable (one line each).
    """
    huggingface_hub = _huggingface_hub(field, name)
    HfApi, snapshot_download = huggingface_hub.HfApi, huggingface_hub.snapshot_download
    repo_id, _, revision = name.partition("@")
    cache, errors = hub_cache_dir(), (OSError, ValueError, huggingface_hub.errors.HfHubHTTPError)
    try:
        if not pinned:
            return str(
                snapshot_download(
                    repo_id,
                    repo_type="dataset",
                    revision=revision or None,
                    cache_dir=cache,
                    allow_patterns=list(DATA_FILES),
                    local_files_only=True,
                )
            )
    except errors:  # not cached: streamed
        pass
    if offline():
        raise ValueError(
            f"{field}={name} is not in the HuggingFace cache ({cache}) and HF_HUB_OFFLINE is set, so it cannot be "
            f"streamed from the hub; unset HF_HUB_OFFLINE, or download it first (hf download {repo_id} --repo-type "
            "dataset) into this cache."
        )
    try:
        info = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).dataset_info(repo_id, revision=revision or None)
    except errors as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{field}={name}: looking it up on the hub failed ({reason}); check the id and your access (HF_TOKEN or "
            "`hf auth login` for a gated repo), or give a local folder."
        ) from None
    return f"{HUB_STREAM}{repo_id}@{info.sha or revision or 'main'}"


def _huggingface_hub(field: str, name: str) -> Any:
    """The ``huggingface_hub`` module (the optional extra ``lightning-dist[hf]``), or a one-line error naming the
    field whose hub id needs it."""
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(
            f"{field}={name} is not a local path, and a hub id needs huggingface_hub; pip install "
            "'lightning-dist[hf]', or give a local folder."
        ) from None
    return huggingface_hub
