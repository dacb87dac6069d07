"""Typos never pass: a key the typed schema does not have, a config group option that does not exist, each refused in
one line naming the closest names (and Hydra's other errors composing the config said in one line).

Hydra's ``+key=value`` adds a key to any node, and merging into our dataclasses would drop one the schema lacks, so
``+model.n_layer=4`` ran with the key ignored; for ``model.n_layer=4`` Hydra's own hint was to add the ``+``. Our
typed groups take only their fields; ``+`` adds to the free-form ones: ``callbacks``, ``trainer`` (any Lightning
``Trainer`` argument, checked by :mod:`~lightning_dist.config.trainer_args`), the arguments of a custom model or data
(``_target_``) and ``cluster.slurm.additional``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import typing
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException

from lightning_dist.config.trainer_args import typed_trainer
from lightning_dist.errors import first_line

#: Fields of the root config that hold a group whose schema depends on what was chosen, or free-form values.
_CHOSEN = ("model", "data")
_FREE_FORM = ("trainer", "callbacks", "hydra")


def unknown_key(node: Any, schema: type, path: str = "", choices: dict[str, type] | None = None) -> str | None:
    """The first key of the composed config ``node`` (a dict) that ``schema`` (a dataclass) lacks, as one line with
    the closest field names; ``None`` when every key is a field. ``choices``: the schema of each of ``_CHOSEN``."""
    names = _field_types(schema)
    for key, value in node.items():
        full = f"{path}{key}"
        if key not in names:
            return unknown_field_line(full, schema)
        kind = (choices or {}).get(key) if not path and key in _CHOSEN else names[key]
        if (not path and key in _FREE_FORM) or not isinstance(value, dict):
            continue
        if dataclasses.is_dataclass(kind):
            found = unknown_key(value, kind, f"{full}.")
            if found:
                return found
    return None


def unknown_field_line(key: str, schema: type) -> str:
    """One line for ``key`` (``model.n_layer``), which the dataclass ``schema`` of its group does not have."""
    group, _, name = key.rpartition(".")
    fields = sorted(_field_types(schema))
    # A field of one of its sections (parallelism.schedule: parallelism.pipeline.schedule; cp_attention: the
    # context section's attention), as a flat name of an earlier version would give it.
    close = [
        f"{section}.{leaf}"
        for section, kind in _field_types(schema).items()
        if dataclasses.is_dataclass(kind)
        for leaf in _field_types(kind)
        if name == leaf or name.endswith(f"_{leaf}")
    ]
    close = close or [f for f in fields if f.startswith(name) or name.startswith(f)][:3]  # n_layer: n_layers
    close = close or difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
    prefix = f"{group}." if group else ""
    hint = f"did you mean {' or '.join(prefix + c for c in close)}?" if close else f"its fields: {', '.join(fields)}"
    where = group or "the config"
    return f"{key} is not a field of {where} ({schema.__name__}); {hint} (a + adds keys to free-form groups only)"


def unknown_option_line(group: str, value: str, options: list[str]) -> str:
    """One line for ``group=value`` where the config group ``group`` has no option ``value``."""
    real = sorted(option for option in options if not option.endswith("_schema"))
    close = difflib.get_close_matches(value, real, n=1, cutoff=0.5)
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    return f"{group}={value} is not an option of {group}: use one of {', '.join(real)}{hint}"


def group_options(conf_dir: Path, group: str) -> list[str] | None:
    """The options of the config group ``group`` (its YAML files in ``conf_dir``), or ``None`` if it is no group."""
    folder = Path(conf_dir) / group
    if not folder.is_dir() or group.startswith("hydra"):
        return None  # hydra/launcher and the like: their options come from plugins too
    return sorted(path.stem for path in folder.glob("*.yaml"))


def search_dirs(args: list[str]) -> list[Path] | None:
    """The config folders the command line ``args`` adds to Hydra's search path (``--config-dir`` / ``-cd``,
    ``--config-path`` / ``-cp``, ``hydra.searchpath=[file://..., pkg://...]``), in order; ``None`` when one cannot be
    found here (a package that is not installed): what it holds is then unknown."""
    found: list[Path] = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd", "--config-path", "-cp") and i + 1 < len(args):
            found.append(Path(args[i + 1]).expanduser())
        elif arg.startswith(("--config-dir=", "--config-path=")):
            found.append(Path(arg.partition("=")[2]).expanduser())
        elif arg.lstrip("+").startswith("hydra.searchpath="):
            for entry in arg.partition("=")[2].strip("[]").split(","):
                folder = _search_entry(entry.strip().strip("'\""))
                if folder is None:
                    return None
                found.append(folder)
    return found


def _search_entry(entry: str) -> Path | None:
    """The folder of one ``hydra.searchpath`` entry: ``file://<folder>``, ``pkg://<package>[/<folder>]``."""
    if entry.startswith("pkg://"):
        package, _, below = entry.removeprefix("pkg://").replace("/", ".").partition(".")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        return Path(places[0]).joinpath(*below.split(".")) if places else None
    return Path(entry.removeprefix("file://")).expanduser()


def hydra_error_line(err: BaseException) -> str | None:
    """Our one line for Hydra's error composing the config, in place of Hydra's text and hint; ``None`` for an error
    that is not Hydra's own (a folder it could not write, say)."""
    if isinstance(err, MissingConfigException):  # an OSError too: before any check for one
        group, _, value = (err.missing_cfg_file or "").rpartition("/")
        if group:
            return unknown_option_line(group, value, list(err.options or []))
        return first_line(err)
    if not isinstance(err, HydraException):
        return None
    schema, key = getattr(err.__cause__, "object_type", None), getattr(err.__cause__, "full_key", None)
    if isinstance(err, ConfigCompositionException) and dataclasses.is_dataclass(schema) and key:
        kind = _field_types(schema).get(str(key).rpartition(".")[2])
        if dataclasses.is_dataclass(kind):  # a value given to a section (activation_checkpointing=full)
            leaves = list(_field_types(kind))
            return (
                f"{key} is a section of options, not one value; set its fields ({', '.join(leaves)}), e.g. "
                f"{key}.{leaves[0]}=..."
            )
        if kind is None:
            return unknown_field_line(key, schema)  # Hydra's hint would be to add the key with +, which runs without
        return f"{key}: {first_line(err.__cause__)}"  # a value of the wrong type
    if isinstance(err, ConfigCompositionException) and str(key).startswith("trainer."):
        given = re.search(rf"use \+{re.escape(key)}=(.*)", str(err))  # Hydra's hint holds the value given
        try:  # not a Trainer argument (named with the closest), or one the app sets
            typed_trainer({key.removeprefix("trainer."): given.group(1) if given else None})
        except ValueError as unknown:
            return str(unknown)
        return f"{key} is a Trainer argument the trainer group does not list: add it with +{key}=..."
    if isinstance(err.__cause__, OSError):
        return None
    cause = f": {first_line(err.__cause__)}" if err.__cause__ is not None else ""
    return f"{first_line(err)}{cause}"


def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {field.name: hints.get(field.name) for field in dataclasses.fields(schema)}
