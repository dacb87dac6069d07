"""``lightning-dist-export CKPT OUT``: a checkpoint of any layout as one weights file or as HuggingFace safetensors.

Runs in one process with no process group. A sharded checkpoint (DCP) is read a few tensors at a time, each whole
(DCP assembles it from the shards of whatever layout wrote it, pipeline stages included), so the HuggingFace export
never holds more than one output shard (``--max-shard-size``) in memory. The single file holds every weight once:
``torch.save`` writes one archive from one dict.

Examples::

    lightning-dist-export outputs/2026-11-24/10-00-00 model.pt          # the run's newest checkpoint, one file
    lightning-dist-export outputs/.../checkpoints/step-00000300 hf/     # HuggingFace folder (config.json, safetensors)
    lightning-dist-export outputs/<a LoRA run> adapter/                 # a peft adapter folder (model.lora)
    lightning-dist-export outputs/<a LoRA run> merged/ --merge          # the adapters merged into the weights

**OUT is the export's own.** The export writes nothing but OUT (through a temporary name beside it), and never
into a checkpoint, a run's ``checkpoints/`` folder, or a folder that holds the checkpoint it reads. An exported
folder carries :data:`~lightning_dist.checkpoint.folder.EXPORT_MARKER`: its files' sizes and CRC-32s (what the
project checks before it reads the folder back: ``lightning-dist-eval``, ``-generate``, ``init_from``) and the mark
that ``--overwrite`` looks for: it replaces an earlier export only, never a run folder, its parent or a checkpoint.
A single file is replaced only when it is an earlier single-file export (a ``{name: tensor}`` archive).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_dist import _compat
from lightning_dist.checkpoint.adapters import MergedCheckpoint, describe, export_adapter, lora_of
from lightning_dist.checkpoint.folder import EXPORT_MARKER, complete_checkpoints, pointed
from lightning_dist.checkpoint.model_card import model_card, push_to_hub, read_report
from lightning_dist.checkpoint.store import check_loadable, unchecked_note
from lightning_dist.checkpoint.weights import MODULE_ATTR
from lightning_dist.errors import first_line
from lightning_dist.manifest import make_readable, read_manifest, write_manifest
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.gpt_hf import Converted, hf_config, hf_tensors, same
from lightning_dist.models.qlora import NF4_NAMES, dequantized, nf4_target

_PREFIX = "state_dict."  # Lightning's checkpoint key of the module's weights; DCP flattens nested keys with dots

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: What an exported folder takes from the HuggingFace folder the run started from (those of them it holds).
HF_EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class Checkpoint:
    """Read access to one checkpoint's weights, a tensor at a time, whatever layout wrote it.

    Args:
        path: A sharded checkpoint folder, a single checkpoint file, or a run folder (its newest checkpoint).
        checksums: Check each file's CRC-32 against the checkpoint's manifest (else sizes only) before reading it.

    Raises:
        ValueError: No checkpoint there, or a damaged one (one line naming the file and the newest whole one).
    """

    def __init__(self, path: Path, checksums: bool = True) -> None:
        path = Path(path)
        if (path / "checkpoints").is_dir():
            published = complete_checkpoints(path / "checkpoints")
            found = pointed(path / "checkpoints") or (published[-1] if published else None)
            if found is None:
                raise ValueError(f"{path} is a run folder without a complete checkpoint in {path / 'checkpoints'}.")
            path = found  # the run's newest: refused below if damaged, naming the newest whole one to export instead
        if not path.exists():
            raise ValueError(f"{path} does not exist; give a checkpoint folder or file, or a run folder.")
        check_loadable(path, checksums)
        self.path = path
        self.unchecked = unchecked_note(path)  #: a line for a checkpoint without a manifest (sizes checked only)
        self._file: dict[str, Any] | None = None
        if path.is_dir():
            meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            self.shapes = {
                k[len(_PREFIX) :]: (torch.Size(m.size), m.properties.dtype)
                for k, m in meta.items()
                if k.startswith(_PREFIX) and hasattr(m, "properties")  # tensors (not bytes)
            }
            rest = torch.load(path / _compat.checkpoint_metadata_file(), weights_only=False, map_location="cpu")
        else:
            rest = torch.load(path, weights_only=False, map_location="cpu", mmap=True)
            self._file = rest["state_dict"]
            self.shapes = {k: (v.shape, v.dtype) for k, v in self._file.items() if isinstance(v, Tensor)}
        self.hyper_parameters: dict[str, Any] = dict(rest.get("hyper_parameters") or {})
        self._rest = rest

    @property
    def names(self) -> list[str]:
        """The module's tensor names (``LightningModule.state_dict()`` keys)."""
        return list(self.shapes)

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of the whole tensor ``name`` (in ``dtype`` if given)."""
        shape, stored = self.shapes[name]
        return shape.numel() * (dtype or stored).itemsize

    def read(self, names: list[str]) -> dict[str, Tensor]:
        """The whole tensors ``names``, on the CPU (one DCP read for all of them)."""
        if self._file is not None:
            return {name: dequantized(self._file[name]) for name in names}
        state = {}
        nf4 = set(self.nf4_names)
        for name in names:
            shape, dtype = self.shapes[name]
            state[_PREFIX + name] = nf4_target(shape, dtype) if name in nf4 else torch.empty(shape, dtype=dtype)
        dcp.load(state, checkpoint_id=self.path, no_dist=True)
        return {name[len(_PREFIX) :]: dequantized(tensor) for name, tensor in state.items()}

    @property
    def nf4_names(self) -> list[str]:
        """The tensors a QLoRA run saved in 4 bits (torchao's NF4; :meth:`read` gives them dequantized)."""
        return list(self._rest.get(NF4_NAMES, []))


def export_torch(ckpt: Checkpoint, out: Path, dtype: torch.dtype | None = None) -> Path:
    """Write the module's weights as one ``torch.save`` file of ``{name: tensor}`` (``weights_only=True`` loads it).

    The names are the LightningModule's, so ``module.load_state_dict(torch.load(out, weights_only=True))`` restores
    the model on one process.
    """
    weights = {name: _cast(t, dtype) for name, t in ckpt.read(ckpt.names).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out)
    return out


def export_hf(ckpt: Checkpoint, out: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a HuggingFace model folder: ``config.json`` and safetensors shards (with their index when several).

    The built-in GPT becomes ``LlamaForCausalLM`` (``arch=llama``) or ``GPT2LMHeadModel``; an :class:`HFCausalLM`
    gets its own class and config back. A run that started from a HuggingFace folder (``model.pretrained`` /
    ``init_from``, kept as ``hf_source`` in the checkpoint) gets that folder's tokenizer and generation config too,
    so ``AutoTokenizer`` / ``generate`` work on the export as on the original.

    Raises:
        ValueError: The checkpoint's module is neither (a user's own LightningModule: use the single file).
    """
    from safetensors.torch import save_file

    config, plan = _hf_plan(ckpt)
    shards = list(_shards(ckpt, plan, dtype, max_shard_bytes))
    out.mkdir(parents=True, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for filename, shard in zip(names, shards):
        tensors: dict[str, Tensor] = {}
        read = ckpt.read(sorted({source for item in shard for source in item.sources}))
        for item in shard:
            tensors[item.name] = _cast(item.combine(*(read[s] for s in item.sources)), dtype).contiguous()
            weight_map[item.name] = filename
            total += tensors[item.name].nbytes
        save_file(tensors, out / filename, metadata={"format": "pt"})
        del tensors, read
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    source = ckpt.hyper_parameters.get("hf_source")
    if source:
        copy_tokenizer_files(Path(source), out)
    return out


def copy_tokenizer_files(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer files and ``generation_config.json`` the HuggingFace folder ``source`` holds (the folder
    the run started from) into ``out``; returns the names copied. A folder no longer there is a warning only."""
    if not source.is_dir():
        warnings.warn(
            f"the run started from {source}, which is gone: no tokenizer copied next to the weights; copy "
            "its tokenizer files into the exported folder yourself.",
            stacklevel=2,
        )
        return []
    copied = []
    for name in HF_EXTRA_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)  # follows the HuggingFace cache's links to the blobs
            copied.append(name)
    return copied


def _hf_plan(ckpt: Checkpoint) -> tuple[dict[str, Any], list[Any]]:
    """The HuggingFace config and the list of tensors to write, each with the checkpoint tensors it is made from."""
    hp = ckpt.hyper_parameters
    if isinstance(hp.get("model"), dict) and "arch" in hp["model"]:
        gpt = GPTConfig(**hp["model"])
        plan = [Converted(c.name, tuple(MODULE_ATTR + s for s in c.sources), c.combine) for c in hf_tensors(gpt)]
        return hf_config(gpt), plan
    if "hf_config" in hp:
        config = dict(hp["hf_config"])
        tied = config.get("tie_word_embeddings", False)
        names = [n for n in ckpt.names if n.startswith(MODULE_ATTR)]
        kept = [n for n in names if not (tied and n.endswith("lm_head.weight"))]  # transformers re-ties the head
        plan = [Converted(n[len(MODULE_ATTR) :], (n,), same) for n in kept]
        return config, plan
    raise ValueError(
        f"{ckpt.path} holds neither the built-in GPT nor an HFCausalLM (hyper_parameters: {sorted(hp) or 'none'}); "
        "export your own module with --format torch (OUT ending in .pt)."
    )


def _shards(ckpt: Checkpoint, plan: list[Any], dtype: torch.dtype | None, limit: int) -> Iterator[list[Any]]:
    """``plan`` cut, in order, into lists whose output bytes stay under ``limit`` (a bigger tensor goes alone)."""
    shard: list[Any] = []
    size = 0
    for item in plan:
        nbytes = sum(ckpt.nbytes(source, dtype) for source in item.sources)
        if shard and size + nbytes > limit:
            yield shard
            shard, size = [], 0
        shard.append(item)
        size += nbytes
    if shard:
        yield shard


def _cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


@contextmanager
def staged(out: Path, folder: bool, overwrite: bool = False) -> Iterator[Path]:
    """Where to write an export that appears at ``out`` whole or not at all: a temporary file or folder beside it (on
    the same filesystem, so the rename is atomic), renamed into place once the block is done, removed if it fails.

    Checked before the block runs (before any checkpoint is read): ``out`` holds nothing (an empty folder is fine;
    ``overwrite``: what it holds is replaced, only once the new export is whole), and its folder takes files.

    Raises:
        ValueError: ``out`` is in the way or cannot be written (one line).
    """
    out = Path(out)
    kind = "folder" if folder else "file"
    if out.exists() and out.is_dir() != folder:
        raise ValueError(f"{out} is a {'folder' if out.is_dir() else 'file'}, not the {kind} this export writes.")
    if out.exists() and not overwrite and (not folder or any(out.iterdir())):
        what = "files (an earlier export?)" if folder else "a file"
        raise ValueError(f"{out} already holds {what}; give a new {kind}, or pass --overwrite to replace it.")
    if out.exists() and overwrite and (not folder or any(out.iterdir())):
        check_replaceable(out, folder)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if folder:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        else:
            handle, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
            os.close(handle)
            tmp = Path(name)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod((0o777 if folder else 0o666) & ~umask)  # mkdtemp / mkstemp make it private
    except OSError as err:
        reason = "Not a directory" if isinstance(err, FileExistsError) else err.strerror  # a file in the path
        raise ValueError(f"{out} cannot be written ({reason}); give an OUT in a folder you can write.") from None
    try:
        yield tmp
        make_readable(tmp)  # safetensors writes its files 0600
        if folder and out.exists():  # the old one goes only once the new one is whole
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise


#: What a run folder holds (names kept here: the run layer is above this one): an export never replaces a folder with
#: one of them, nor writes into a checkpoint or a run's checkpoints folder.
_RUN_FOLDER_NAMES = ("checkpoints", ".hydra", ".run.lock", "report.json", "train.log", "csv", "wandb")


def check_out(out: Path, source: Path, folder: bool, overwrite: bool) -> None:
    """Refuse an OUT that is not the export's own to write (before anything is read or written): the checkpoint
    ``source`` or a folder holding it, a place inside a checkpoint or a run's ``checkpoints`` folder, and (with
    ``overwrite``) anything but an earlier export (:func:`check_replaceable`).

    Raises:
        ValueError: One line naming OUT, what it holds and the fix.
    """
    out, source = Path(out).absolute(), Path(source).absolute()
    resolved, read = out.resolve(), source.resolve()
    if resolved == read or resolved in read.parents:
        raise ValueError(
            f"{out} holds the checkpoint this export reads ({source}): writing there would replace it; give OUT "
            "outside it (a new folder)."
        )
    for place in [resolved, *resolved.parents]:
        inside = _checkpoint_or_store(place)
        if inside is not None:
            raise ValueError(
                f"{out} is inside {inside} {place}, which an export must not change; give OUT outside it (a new "
                "folder)."
            )
    if out.exists() and overwrite and (not folder or (out.is_dir() and any(out.iterdir()))):
        check_replaceable(out, folder)


def check_replaceable(out: Path, folder: bool) -> None:
    """``--overwrite`` replaces an earlier export only: a folder holding :data:`EXPORT_MARKER` (and nothing of a run),
    or a single file that is a ``{name: tensor}`` archive (what a single-file export writes).

    Raises:
        ValueError: ``out`` is anything else (one line: what it is, and the fix).
    """
    if folder and out.is_dir():
        held = [name for name in _RUN_FOLDER_NAMES if (out / name).exists()]
        if held or _checkpoint_or_store(out) is not None:
            what = f"a run's {held[0]}" if held else "a checkpoint"
            raise ValueError(
                f"{out} holds {what}, not an earlier export: --overwrite replaces only a folder lightning-dist-export "
                f"wrote (it holds {EXPORT_MARKER}); give a new folder for OUT."
            )
        if read_manifest(out, EXPORT_MARKER) is None:
            raise ValueError(
                f"{out} holds files that are not an earlier export (no {EXPORT_MARKER}): --overwrite replaces only a "
                "folder lightning-dist-export wrote; give a new folder for OUT, or empty this one yourself."
            )
    elif not folder and out.is_file() and not _is_weights_file(out):
        raise ValueError(
            f"{out} is not an earlier single-file export (a {{name: tensor}} archive): --overwrite replaces only "
            "those; give a new file for OUT."
        )


def _checkpoint_or_store(path: Path) -> str | None:
    """``"the checkpoint"`` when ``path`` is a sharded checkpoint folder, ``"the checkpoints folder"`` for a run's
    ``checkpoints`` folder, else ``None``."""
    if not path.is_dir():
        return None
    if (path / ".metadata").is_file() and (path / _compat.checkpoint_metadata_file()).is_file():  # DCP's + Lightning's
        return "the checkpoint"
    if path.name == "checkpoints" and (complete_checkpoints(path) or (path / "latest").is_file()):
        return "the checkpoints folder"
    return None


def _is_weights_file(path: Path) -> bool:
    """Whether the file ``path`` is what a single-file export writes: a ``torch.save`` of ``{name: tensor}`` only
    (``mmap``: the tensors' bytes are not read)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not an archive, or one holding more than tensors (a Lightning checkpoint): not an export
        return False
    return isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-dist-export",
        description="Export a lightning-dist checkpoint (any layout) as one weights file or a HuggingFace folder.",
    )
    parser.add_argument("ckpt", type=Path, help="a checkpoint folder or file, or a run folder (its newest checkpoint)")
    parser.add_argument("out", type=Path, help="a file ending in .pt/.pth (one file) or a folder (HuggingFace)")
    parser.add_argument("--format", choices=("torch", "hf"), help="default: torch for .pt/.pth, else hf")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point weights (default: as stored)")
    parser.add_argument("--max-shard-size", default="5GB", help="HuggingFace shard size, e.g. 5GB or 500MB")
    parser.add_argument(
        "--verify",
        choices=("checksums", "sizes"),
        default="checksums",
        help="check the checkpoint's files against its manifest by size and CRC-32 (default), or by size only",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export at OUT (once the new one is whole); never a run folder or a checkpoint",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (model.lora): merge the adapters into the weights (default: a peft adapter folder)",
    )
    parser.add_argument(
        "--push-to-hub", metavar="REPO", help="upload the exported folder to this hub repo, with a model card"
    )
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    args = parser.parse_args(argv)
    fmt = args.format or ("torch" if args.out.suffix in (".pt", ".pth") else "hf")
    try:
        if args.push_to_hub and fmt != "hf":
            raise ValueError(f"--push-to-hub uploads a folder; give a folder for OUT, not {args.out}.")
        check_out(args.out, args.ckpt, folder=fmt == "hf", overwrite=args.overwrite)
        with staged(args.out, folder=fmt == "hf", overwrite=args.overwrite) as tmp:
            ckpt, fmt = _export(args, fmt, tmp)
    except ValueError as err:
        sys.exit(f"lightning-dist-export: {err}")
    except Exception as err:  # a write that fails (a full disk, a quota): one line, and nothing left at OUT
        sys.exit(f"lightning-dist-export: writing {args.out} failed ({first_line(err)}); nothing was left there.")
    print(f"exported {ckpt.path} -> {args.out} ({fmt})")
    if args.push_to_hub:
        try:
            print(f"pushed {args.out} -> {push_to_hub(args.out, args.push_to_hub, args.private, EXPORT_MARKER)}")
        except ValueError as err:  # no network, a token without write access: the export is whole where it is
            files = sorted(p.name for p in args.out.iterdir() if p.name != EXPORT_MARKER)
            sys.exit(
                f"lightning-dist-export: {err}; the export is whole at {args.out} ({len(files)} files: "
                f"{', '.join(files)}): upload it with: hf upload {args.push_to_hub} {args.out} --exclude "
                f"{EXPORT_MARKER}"
            )


def _export(args: argparse.Namespace, fmt: str, tmp: Path) -> tuple[Any, str]:
    """Write the export of ``args.ckpt`` into ``tmp`` (renamed into place by the caller), with its marker; returns
    the checkpoint read and the format written, in words."""
    dtype = DTYPES[args.dtype] if args.dtype else None
    ckpt = Checkpoint(args.ckpt, checksums=args.verify == "checksums")
    if ckpt.unchecked:
        print(f"warning: {ckpt.unchecked}", file=sys.stderr, flush=True)
    lora = lora_of(ckpt.hyper_parameters)
    if args.merge and lora is None:
        raise ValueError(f"--merge: {ckpt.path} holds no LoRA adapters (model.lora.rank=0); leave --merge out.")
    if lora is not None and args.merge:
        ckpt = MergedCheckpoint(ckpt, lora)
    if fmt == "torch":
        export_torch(ckpt, tmp, dtype)
        return ckpt, fmt
    if lora is not None and not args.merge:
        export_adapter(ckpt, lora, tmp, dtype)
        if ckpt.hyper_parameters.get("hf_source"):  # the tokenizer goes with the adapter, as on the hub
            copy_tokenizer_files(Path(ckpt.hyper_parameters["hf_source"]), tmp)
        fmt = describe(tmp)
    else:
        export_hf(ckpt, tmp, dtype, _size(args.max_shard_size))
    if args.push_to_hub:  # the card: base model, layout, tokens seen, loss curve (the run's report.json)
        step = int(ckpt.path.name.rpartition("-")[2]) if ckpt.path.name.startswith("step-") else None
        card = model_card(args.push_to_hub, ckpt.hyper_parameters, read_report(ckpt.path), step)
        (tmp / "README.md").write_text(card)
    write_manifest(tmp, EXPORT_MARKER, kind="lightning-dist-export", source=str(ckpt.path.absolute()), format=fmt)
    return ckpt, fmt


if __name__ == "__main__":
    main()
