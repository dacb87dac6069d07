"""``lightning-dist-train --help``: the app's groups, their options and every field's help, read from the schema.

Each field's help is the docstring under it in its dataclass (:mod:`lightning_dist.config.schema` and the classes it
composes); each option's is the comment at the top of its YAML file in ``conf/``. The same text, as Markdown, is
``docs/reference/config.md``: ``python -m lightning_dist.run.help --markdown > docs/reference/config.md`` writes it
again (``tests/test_help.py`` fails while the committed file differs).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import os
import re
import sys
import textwrap
from functools import cache
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lightning_dist import __version__
from lightning_dist.config.schema import (
    CONF_DIR,
    ClusterConfig,
    DebugConfig,
    HardwareConfig,
    HFModelConfig,
    TrainConfig,
    register_configs,
)
from lightning_dist.config.trainer_args import TrainerConfig
from lightning_dist.data.config import DataConfig
from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.parallel.options import Parallelism

APP = "lightning-dist-train"
#: Groups of conf/ whose fields a dataclass types (model=hf: HFModelConfig; model=custom / data=custom: your class's).
SCHEMAS: dict[str, type] = {
    "model": GPTConfig,
    "data": DataConfig,
    "parallelism": Parallelism,
    "cluster": ClusterConfig,
    "trainer": TrainerConfig,
    "debug": DebugConfig,
    "hardware": HardwareConfig,
}
#: Groups whose options are ``_target_`` nodes (Lightning classes); their fields are the classes' arguments.
TARGET_GROUPS = ("logger", "callbacks")
#: The groups in the order shown.
ORDER = ("model", "data", "parallelism", "cluster", "trainer", "logger", "callbacks", "debug", "recipe", "hardware")
PLAN_APP = "lightning-dist-plan"
PLAN_EXAMPLES = [
    f"{PLAN_APP} model=llama_8b cluster=slurm cluster.num_nodes=2 hardware=h100_sxm     # 16 H100s: which layout",
    f"{PLAN_APP} model=llama_70b cluster.num_nodes=32 data.seq_len=8192 plan.top=5",
    f"{PLAN_APP} recipe=llama_8b_slurm_2x8_h100 plan.format=json > plan.json          # every layout, as JSON",
    f"{PLAN_APP} model=llama_8b cluster.num_nodes=2 plan.trace=true                    # + a traced rank",
    f"{PLAN_APP} model=llama_8b hardware=h100_ethernet_100gbps plan.tokens=1e12    # cost curve: sync vs DiLoCo",
]
EXAMPLES = [
    f"{APP}                                         # the default job: 2 CPU processes, about a minute",
    f"{APP} parallelism=fsdp trainer.max_steps=50   # FSDP2 over both processes",
    f"{APP} -m seed=1,2,3 logger=csv                # a sweep: one run folder per point",
    f"{APP} --help parallelism                      # a group's options and fields",
    f"{APP} --help parallelism.tp                   # one field",
]


# ------------------------------------------------------------------------------------------------ reading the schema
@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (and its bases), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in itertools.pairwise(body):
            named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def fields_of(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted name, type, help)`` of every field of ``cls``, nested dataclasses flattened (``diloco.every``)."""
    rows = []
    for field in dataclasses.fields(cls):
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        nested = _dataclass_named(cls, kind)
        if nested is not None:
            rows += fields_of(nested, f"{prefix}{field.name}.")
        else:
            rows.append((f"{prefix}{field.name}", kind, field_docs(cls).get(field.name, "")))
    return rows


def _dataclass_named(owner: type, name: str) -> type | None:
    found = getattr(sys.modules[owner.__module__], name, None)
    return found if dataclasses.is_dataclass(found) else None


def sections() -> dict[str, type]:
    """The run's settings that have no group: ``optim``, ``checkpoint``, ... (TrainConfig's dataclass fields)."""
    return {
        field.name: _dataclass_named(TrainConfig, field.type)
        for field in dataclasses.fields(TrainConfig)
        if field.name not in SCHEMAS and _dataclass_named(TrainConfig, str(field.type)) is not None
    }


def top_fields() -> list[tuple[str, str, str]]:
    """TrainConfig's own scalar fields (``seed``, ``resume``, ...)."""
    skip = {*SCHEMAS, *TARGET_GROUPS, *sections()}
    return [row for row in fields_of(TrainConfig) if row[0].split(".")[0] not in skip]


def options(group: str) -> list[tuple[str, str]]:
    """``(option, its description)`` of a config group: its YAML files (the registered ``*_schema`` are none)."""
    rows = []
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        comment = []
        for line in path.read_text().splitlines():
            if line.startswith("# @package"):
                continue
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("# ").rstrip())
        rows.append((path.stem, " ".join(comment)))
    return rows


def groups() -> list[str]:
    """Every config group of ``conf/``, in the order of ``train.yaml``'s defaults."""
    return [group for group in ORDER if (CONF_DIR / group).is_dir()]


def group_doc(group: str) -> str:
    """What a group is: TrainConfig's docstring for its field, else a word on the whole-config groups."""
    docs = field_docs(TrainConfig)
    if group == "recipe":
        return "Named, reproducible runs: a whole-config override (recipes/README.md lists what each reaches)."
    return docs.get(group, "")


# ------------------------------------------------------------------------------------------------------ composing
def composed(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """The config ``lightning-dist-train <overrides>`` would run, and the option chosen in each group."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items() if not str(k).startswith("hydra/")}
    return cfg, choices


def _value(cfg: DictConfig, dotted: str) -> str:
    value = OmegaConf.select(cfg, dotted, default="?", throw_on_missing=False)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return "null" if value is None else str(value)


# ------------------------------------------------------------------------------------------------------ the text
def overview(cfg: DictConfig, choices: dict[str, str]) -> str:
    """``--help``: the app, its usage, each group's options (the chosen one starred) and the settings."""
    lines = [
        f"{APP} {__version__}: train with any parallel layout (pp, dp_replicate, dp_shard, cp, tp) inside Lightning's",
        "Trainer, configured with Hydra. Every field below can be set on the command line.",
        "",
        f"usage: {APP} [GROUP=OPTION ...] [KEY=VALUE ...]     one run (outputs/<date>/<time>/)",
        f"       {APP} -m KEY=A,B [...]                      a sweep (Hydra multirun)",
        f"       {APP} --help GROUP | GROUP.FIELD | SECTION  a group's options and fields, or one field's help",
        "",
        "config groups (GROUP=OPTION; * = chosen now):",
    ]
    for group in groups():
        chosen = choices.get(group)
        names = [f"{name}*" if name == chosen else name for name, _ in options(group)]
        lines += _wrapped(f"  {group}", ", ".join(names), 15)
        lines += [f"  {'':<12} {line}" for line in textwrap.wrap(plain(group_doc(group)), 104)]
    lines += ["", "settings without a group (KEY=VALUE; --help SECTION):"]
    for name, cls in sections().items():
        lines.append(f"  {name:<12} {field_docs(TrainConfig).get(name) or (cls.__doc__ or '').splitlines()[0]}")
    lines.append(f"  {'':<12} and {', '.join(name for name, _, _ in top_fields())}")
    lines += ["", "examples:", *(f"  {example}" for example in EXAMPLES), ""]
    lines.append("more: --cfg job prints the composed config; --hydra-help Hydra's own flags; docs/reference/config.md")
    return "\n".join(lines)


def plan_overview(cfg: DictConfig, choices: dict[str, str]) -> str:
    """``lightning-dist-plan --help``: what it reads of the training config, its own settings and the groups."""
    lines = [
        f"{PLAN_APP} {__version__}: rank every layout of a training job (memory, tokens/s, MFU, exposed",
        f"communication) before renting the machines. It composes the config {APP} would run and writes nothing.",
        "",
        f"usage: {PLAN_APP} [GROUP=OPTION ...] [KEY=VALUE ...]",
        f"       {PLAN_APP} --help GROUP | GROUP.FIELD | plan      a group's options and fields, or one field's help",
        "",
        "what a plan reads:",
        "  model                the model planned (a Llama-family model=hf as its shape)",
        "  data                 data.global_batch_size x data.seq_len tokens per step (synthetic data: the model's",
        "                       max_seq_len unless data.seq_len is given)",
        "  cluster, hardware    the world: cluster.num_nodes x the devices of a node; the device and its links",
        "  parallelism          what every layout keeps: float8, loss_chunks, cpu_offload, DiLoCo's every / fragments",
        "",
        "plan settings (plan.FIELD=VALUE):",
    ]
    for name, kind, doc in fields_of(sections()["plan"], "plan."):
        lines.append(f"  {name}: {kind} = {_value(cfg, name)}")
        lines += [f"      {line}" for line in textwrap.wrap(plain(doc), 110)]
    lines += ["", "config groups (GROUP=OPTION; * = chosen now):"]
    for group in groups():
        chosen = choices.get(group)
        lines += _wrapped(f"  {group}", ", ".join(f"{n}*" if n == chosen else n for n, _ in options(group)), 15)
    lines += ["", "examples:", *(f"  {example}" for example in PLAN_EXAMPLES), ""]
    lines.append("more: --cfg job prints the composed config; docs/planner.md")
    return "\n".join(lines)


def group_text(group: str, cfg: DictConfig, choices: dict[str, str]) -> str:
    """``--help <group>``: its options, then each field with its type, value now and help."""
    lines = [*textwrap.wrap(f"{group}: {plain(group_doc(group))}", 118), ""]
    if (CONF_DIR / group).is_dir():
        lines.append(f"options ({group}=OPTION; * = chosen now):")
        for name, doc in options(group):
            star = "*" if choices.get(group) == name else " "
            lines += _wrapped(f"  {name}{star}", doc, 18)
        lines.append("")
    rows = _rows(group, cfg)
    if rows:
        lines.append(f"fields ({group}.FIELD=VALUE; = value now):")
        for name, kind, doc in rows:
            lines.append(f"  {name}: {kind} = {_value(cfg, name)}")
            lines += [f"      {line}" for line in textwrap.wrap(plain(doc), 110)]
    elif group in TARGET_GROUPS:
        nodes = OmegaConf.to_container(cfg[group]) or {}
        lines.append(f"now: {nodes}" if nodes else "now: none")
        lines.append(f"each {group}.<name> is built from its _target_; add one: +{group}.<name>._target_=<class>")
    return "\n".join(lines).rstrip()


def _rows(group: str, cfg: DictConfig) -> list[tuple[str, str, str]]:
    if group == "model" and cfg.model.get("kind") == "hf":
        return fields_of(HFModelConfig, "model.")
    if group in SCHEMAS:  # trainer.extra holds the +trainer.<name> arguments: no field of its own
        return [row for row in fields_of(SCHEMAS[group], f"{group}.") if row[0] != "trainer.extra"]
    if group in sections():
        return fields_of(sections()[group], f"{group}.")
    return []


def field_text(dotted: str, cfg: DictConfig) -> str | None:
    """``--help <group>.<field>``: one field's type, value now and help; ``None`` when there is no such field."""
    for name, kind, doc in _rows(dotted.split(".")[0], cfg) + top_fields():
        if name == dotted:
            text = [f"{name}: {kind} = {_value(cfg, name)}", *textwrap.wrap(plain(doc), 110), f"set: {name}=..."]
            return "\n".join(text)
    return None


def help_text(topic: str | None, overrides: list[str], app: str = APP) -> tuple[str, bool]:
    """The text ``<app> --help [topic]`` prints with these overrides, and whether the topic was found."""
    cfg, choices = composed(overrides)
    if topic is None:
        return (plan_overview(cfg, choices) if app == PLAN_APP else overview(cfg, choices)), True
    if topic in groups() or topic in sections():
        return group_text(topic, cfg, choices), True
    found = field_text(topic, cfg)
    if found is not None:
        return found, True
    names = [*groups(), *sections(), *(row[0] for group in SCHEMAS for row in _rows(group, cfg))]
    names += [row[0] for section in sections() for row in _rows(section, cfg)] + [row[0] for row in top_fields()]
    close = difflib.get_close_matches(topic, names, n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; the groups: {', '.join(groups())}"
    return f"--help {topic}: no such group or field{hint}", False


def answer_help(args: list[str], app: str = APP) -> None:
    """``<app> --help [GROUP | GROUP.FIELD | SECTION]`` with any overrides: ours, from the schema's docstrings
    (Hydra's own is ``--hydra-help``). Exits 0, or 2 naming the closest topics for one that does not exist."""
    flag = next(i for i, arg in enumerate(args) if arg in ("--help", "-h"))
    after = args[flag + 1] if flag + 1 < len(args) else ""
    topic = after if after and not after.startswith("-") and "=" not in after else None
    text, found = help_text(topic, [arg for arg in args if "=" in arg and not arg.startswith("-")], app)
    try:
        print(text, file=sys.stdout if found else sys.stderr, flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0 if found else 2)


def plain(text: str, markdown: bool = False) -> str:
    """A docstring's reST markup as the terminal (no quotes) or Markdown (single backticks) shows it."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"``{m.group(1).split('.')[-1]}``", text)
    return text.replace("``", "`" if markdown else "")


def _wrapped(head: str, text: str, width: int) -> list[str]:
    body = textwrap.wrap(text, 118 - width) or [""]
    return [f"{head:<{width}}{body[0]}", *(f"{'':<{width}}{line}" for line in body[1:])]


# ------------------------------------------------------------------------------------------------------ markdown
def markdown() -> str:
    """docs/reference/config.md: every group's options and every field, with its type, default and help."""
    cfg, choices = composed([])
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the schema's docstrings and conf/ by `python -m lightning_dist.run.help --markdown >",
        "docs/reference/config.md`; tests/test_help.py fails when this file is stale. Do not edit by hand. -->",
        "",
        f"Every field is set on the command line as `{APP} group.field=value`; a group's option as `group=option`.",
        f"Defaults are what `{APP}` composes with no overrides. The same text on the terminal: `{APP} --help <group>`.",
        "",
    ]
    for group in [*groups(), *sections()]:
        out += [f"## {group}", "", plain(group_doc(group), markdown=True), ""]
        if (CONF_DIR / group).is_dir():
            out += ["| option | what it is |", "|---|---|"]
            out += [
                f"| `{name}`{' (default)' * (choices.get(group) == name)} | {_cell(doc)} |"
                for name, doc in options(group)
            ]
            out.append("")
        rows = _rows(group, cfg)
        if rows:
            out += [*_table(rows, cfg), ""]
        if group == "model":  # model=hf's own fields
            out += [
                "With `model=hf`:",
                "",
                *_table(fields_of(HFModelConfig, "model."), cfg, defaults=HFModelConfig()),
                "",
            ]
    out += ["## Other settings", "", *_table(top_fields(), cfg)]
    return "\n".join(out) + "\n"


def _attr(obj: Any, dotted: str) -> Any:
    """``obj``'s field at a dotted path (``lora.rank``)."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _table(rows: list[tuple[str, str, str]], cfg: DictConfig, defaults: Any = None) -> list[str]:
    """A Markdown table of fields; their defaults from ``cfg`` (or from the dataclass instance ``defaults``)."""
    lines = ["| field | type | default | help |", "|---|---|---|---|"]
    for name, kind, doc in rows:
        value = _value(cfg, name) if defaults is None else str(_attr(defaults, name.split(".", 1)[1]))
        lines.append(f"| `{name}` | {_cell(f'`{kind}`')} | {_cell(f'`{value}`')} | {_cell(doc)} |")
    return lines


def _cell(text: str) -> str:
    return plain(text, markdown=True).replace("|", "\\|")


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_dist.run.help [--markdown | topic]``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--markdown"]:
        sys.stdout.write(markdown())
        return
    text, found = help_text(argv[0] if argv else None, [])
    print(text, file=sys.stdout if found else sys.stderr)
    if not found:
        raise SystemExit(2)


if __name__ == "__main__":
    main()
