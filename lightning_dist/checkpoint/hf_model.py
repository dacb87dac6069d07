"""The HuggingFace model a run, a checkpoint or a folder stands for: what evaluation and generation load.

:func:`resolve_hf_model` takes a HuggingFace model folder, a peft adapter folder, a checkpoint folder or a run folder
(its newest complete checkpoint) and gives the folder transformers loads and, for a LoRA run, the adapter folder peft
puts on it. A checkpoint's own ``hf/`` folder (``checkpoint.save_hf=true``) is read as it is; a checkpoint without one
is exported first (``lightning-dist-export``'s code, into a temporary folder the caller removes).

Every folder this project wrote is checked before it is read: a checkpoint's ``hf/`` against the checkpoint's
manifest (only its ``hf/`` files: the shards are not read then), an exported folder against its marker
(:func:`~lightning_dist.checkpoint.store.check_hf_folder`), a checkpoint exported here as a whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.adapters import export_adapter, lora_of
from lightning_dist.checkpoint.export import Checkpoint, copy_tokenizer_files, export_hf
from lightning_dist.checkpoint.folder import HF_FOLDER, complete_checkpoints, pointed
from lightning_dist.checkpoint.store import check_hf_folder
from lightning_dist.checkpoint.weights import is_hf_folder

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class HFModel:
    """A model to load: ``AutoModelForCausalLM.from_pretrained(folder)``, with the peft ``adapter`` on it if any."""

    folder: Path
    adapter: Path | None = None
    temporary: Path | None = None
    """A folder exported for this load; the caller removes it (:meth:`cleanup`)."""
    checkpoint: Path | None = None
    """The checkpoint it comes from (a run's or checkpoint's model); ``None`` for a HuggingFace / adapter folder."""

    def cleanup(self) -> None:
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)

    def describe(self) -> str:
        return f"{self.folder}" + (f" + adapter {self.adapter}" if self.adapter else "")


def resolve_hf_model(path: Path, base: Path | None = None) -> HFModel:
    """The model ``path`` stands for (see the module docstring); ``base``: the model a LoRA adapter goes on, when its
    ``adapter_config.json`` does not name a local folder.

    Raises:
        ValueError: Nothing loadable there, or an adapter whose base model is not named / not found (one line).
    """
    path = Path(path).expanduser()
    check_hf_folder(path)  # a folder we wrote (a checkpoint's hf/, an export), checked before anything reads it
    if (path / ADAPTER_CONFIG).is_file():
        adapter_base = _adapter_base(path, base)
        check_hf_folder(adapter_base)
        return HFModel(adapter_base, adapter=path)
    if is_hf_folder(path):
        return HFModel(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist; give a run folder, a checkpoint, or a HuggingFace / adapter folder.")
    newest = _newest_checkpoint(path)
    if newest is not None and (newest / HF_FOLDER).is_dir():  # its hf/ checked (what is read), not its shards
        return replace(resolve_hf_model(newest / HF_FOLDER, base), checkpoint=newest)
    ckpt = Checkpoint(path)  # a run folder's newest checkpoint, verified
    tmp = Path(tempfile.mkdtemp(prefix="lightning-dist-hf-"))
    out = tmp / "model"
    lora = lora_of(ckpt.hyper_parameters)
    if lora is not None:
        export_adapter(ckpt, lora, out)
    else:
        export_hf(ckpt, out)
        return HFModel(out, temporary=tmp, checkpoint=ckpt.path)
    source = ckpt.hyper_parameters.get("hf_source")
    if source:
        copy_tokenizer_files(Path(source), out)
    try:
        return HFModel(_adapter_base(out, base), adapter=out, temporary=tmp, checkpoint=ckpt.path)
    except ValueError:
        HFModel(out, temporary=tmp).cleanup()
        raise


def _newest_checkpoint(path: Path) -> Path | None:
    """The checkpoint ``path`` names (a run folder: its newest, as :class:`Checkpoint` takes it), if it is a folder."""
    if (path / "checkpoints").is_dir():
        published = complete_checkpoints(path / "checkpoints")
        path = pointed(path / "checkpoints") or (published[-1] if published else path)
    return path if path.is_dir() and (path / ".metadata").is_file() else None


def _adapter_base(adapter: Path, given: Path | None = None) -> Path:
    base = (
        str(given)
        if given is not None
        else json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    )
    if not base or not is_hf_folder(Path(base)):
        raise ValueError(
            f"{adapter} is a LoRA adapter whose base model ({base or 'not named'}) is not a local HuggingFace folder; "
            f"give the base with --base, or set base_model_name_or_path in its {ADAPTER_CONFIG}."
        )
    return Path(base)


def tokenizer_folder(model: HFModel) -> Path:
    """Where the tokenizer is: the adapter folder when it holds one (what was trained with), else the model's."""
    if model.adapter is not None and any(
        (model.adapter / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return model.adapter
    return model.folder


def load_hf_model(model: HFModel, device: str, dtype: str = "auto") -> tuple[Any, Any]:
    """The transformers model of ``model`` (its LoRA adapter merged in, peft's ``merge_and_unload``) and its tokenizer,
    on ``device``, in eval mode. ``dtype``: ``auto`` (the folder's), ``float32``, ``bfloat16``, ``float16``."""
    import transformers  # optional dependency: lightning-dist[hf]

    kind = "auto" if dtype == "auto" else getattr(torch, dtype)
    net = transformers.AutoModelForCausalLM.from_pretrained(model.folder, dtype=kind)
    if model.adapter is not None:
        import peft  # optional dependency: lightning-dist[hf]

        net = peft.PeftModel.from_pretrained(net, model.adapter).merge_and_unload()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder(model))
    return net.to(device).eval(), tokenizer
