"""``model=hf model.pretrained=<folder or hub id>``: where the pretrained weights are on this machine, and how the run
starts from them. A hub id is read from the local HuggingFace cache, or downloaded into it by one process per node
(``config/hub.py``; ``HF_HUB_OFFLINE=1``: the cache only)."""

from __future__ import annotations

from pathlib import Path

from lightning_dist.config.schema import HFModelConfig, TrainConfig
from lightning_dist.hub import hub_snapshot


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
    """The local HuggingFace folder of ``model.pretrained``: a folder as given, or a hub id's snapshot in the cache
    (downloaded there first when it is not: :func:`~lightning_dist.hub.hub_snapshot`).

    A hub id may name a revision (``org/name@<branch, tag or commit>``; default ``main``).

    Raises:
        ValueError: No such folder, not a HuggingFace folder, or a hub id neither cached nor downloadable (one line).
    """
    path = Path(name).expanduser()
    if path.exists():
        _check_folder(name, path)
        return path.resolve()
    folder = hub_snapshot("model.pretrained", name)
    _check_folder(name, folder)
    return folder.resolve()


def _check_folder(name: str, folder: Path) -> None:
    # deferred: checkpoint.weights reads weights into models (torch, Lightning); only model.pretrained gets here, and
    # the launcher checks any other config without importing those (test_layering: DEFERRED)
    from lightning_dist.checkpoint.weights import is_hf_folder

    if not is_hf_folder(folder):
        raise ValueError(
            f"model.pretrained={name} ({folder}) holds no HuggingFace model (config.json and *.safetensors); save "
            "one with model.save_pretrained(folder, safe_serialization=True), or download its safetensors."
        )
