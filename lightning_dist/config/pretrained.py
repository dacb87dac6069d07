"""``model=hf model.pretrained=<folder or hub id>``: where the pretrained weights are on this machine, and how the run
starts from them. Nothing is ever downloaded: a hub id is looked up in the local HuggingFace cache only."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_dist.config.schema import HFModelConfig, TrainConfig


def resolve_pretrained(cfg: TrainConfig) -> None:
    """On the validation pass's copy of the config: ``model.pretrained`` becomes its local folder, and the run starts
    from that folder as ``init_from`` does (each rank reads its slices once the layout is applied; not when the run
    continues from a checkpoint, whose weights are newer).

    Raises:
        ValueError: Not found (one line saying where it looked and how to get it there), or ``init_from`` names other
            weights.
    """
    model = cfg.model
    if not isinstance(model, HFModelConfig) or model.pretrained is None:
        return
    folder = pretrained_folder(model.pretrained)
    if cfg.init_from is not None and Path(cfg.init_from).expanduser().resolve() != folder:
        raise ValueError(
            f"init_from={cfg.init_from} and model.pretrained={model.pretrained} name different weights; set only "
            "model.pretrained (the run starts from its folder) or only init_from."
        )
    model.pretrained = cfg.init_from = str(folder)


def pretrained_folder(name: str) -> Path:
    """The local HuggingFace folder of ``model.pretrained``: a folder as given, or a hub id's snapshot in the cache.

    A hub id may name a revision (``org/name@<branch, tag or commit>``; default ``main``).

    Raises:
        ValueError: No such folder, not a HuggingFace folder, or a hub id not in the local cache (one line).
    """
    path = Path(name).expanduser()
    if path.exists():
        _check_folder(name, path)
        return path.resolve()
    repo_id, _, revision = name.partition("@")
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download  # optional: ships with transformers (lightning-dist[hf])
    except ImportError:
        raise ValueError(
            f"model.pretrained={name} is not a local folder, and looking a hub id up in the HuggingFace cache needs "
            "huggingface_hub; pip install 'lightning-dist[hf]', or give a local folder."
        ) from None
    try:
        folder = Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or not a valid hub id (HFValidationError)
        offline = " (HF_HUB_OFFLINE is set: unset it there)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise ValueError(
            f"model.pretrained={name} is neither a local folder nor in the HuggingFace cache ({cache}), and nothing "
            f"is downloaded here; fetch it into the cache first where the network is reachable{offline} (hf "
            f"download {repo_id}), or point HF_HUB_CACHE / HF_HOME at the cache that holds it."
        ) from None
    _check_folder(name, folder)
    return folder.resolve()


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


def _check_folder(name: str, folder: Path) -> None:
    # deferred: checkpoint.weights reads weights into models (torch, Lightning); only model.pretrained gets here, and
    # the launcher checks any other config without importing those (test_layering: DEFERRED)
    from lightning_dist.checkpoint.weights import is_hf_folder

    if not is_hf_folder(folder):
        raise ValueError(
            f"model.pretrained={name} ({folder}) holds no HuggingFace model (config.json and *.safetensors); save "
            "one with model.save_pretrained(folder, safe_serialization=True), or download its safetensors."
        )
