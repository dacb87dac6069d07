"""DiLoCo's quality against synchronous training on the synthetic Markov corpus (known entropy floor), on CPU.

Run by hand: ``.venv/bin/python benchmarks/diloco_quality.py [--steps 500] [--replicas 2 4] [--only sync2,h20_2]``.

Every run is the default job (``make train``: the tiny GPT, global batch 32 x 128 tokens, AdamW lr 3e-3 with 20
warmup steps and cosine decay to 0.1x over the run) at the same global batch and tokens, one after the other:

- ``sync``: HSDP with ``dp_shard=1`` (``parallelism=fsdp dp_replicate=N``): gradients all-reduced every step.
- ``H=20`` / ``H=50``: ``parallelism=diloco`` (N replicas, AdamW inside, outer Nesterov SGD lr 0.7 momentum 0.9, the
  paper's; the inner LR schedule is the synchronous run's, as in the paper).
- ``streaming``: H=50 in F=2 fragments (the tiny GPT has 2 blocks: F=4 is refused).
- ``int8``: H=50, the pseudo-gradient exchanged in int8 (per-block absmax scales).

``val/loss`` is evaluated every 100 steps (a multiple of every H, so right after an outer step, when the replicas
are equal) on rank 0's share of the whole validation set (the module logs it without ``sync_dist``): the same data
for every run with the same number of replicas. Written to ``--out`` (default ``outputs/benchmarks/diloco_quality``):
``results.json``, ``results.md`` (the table) and the run report's comparison page ``compare.html`` (val/loss and
train/loss against tokens seen, every run on the main corpus overlaid, the loss floor; ``compare_loss.png``);
``--report-only`` writes the table and the page again from the saved runs without training.

Results (2-core CPU VM shared with other jobs, torch 2.13.0+cpu, gloo, 500 steps = 2.05M tokens; val/loss on rank 0's
share of the validation set; "replica bytes/step": ``diloco/bytes_per_step``, for sync the window's ``comm/dp/bytes``;
``seed7``: ``seed=7``, which also draws another corpus, hence another floor)::

    .venv/bin/python benchmarks/diloco_quality.py   # ~9.5 min; then --replicas 2 --seed 7 --only sync_2_seed7,...

    | run               | n | 0.41M  | 0.82M  | 1.23M  | 1.64M  | 2.05M  | vs sync | vs floor | bytes/step |
    |-------------------|---|--------|--------|--------|--------|--------|---------|----------|------------|
    | sync (HSDP)       | 2 | 1.1853 | 1.1246 | 1.1049 | 1.0918 | 1.0859 | +0.0000 | +0.0093  |    525,576 |
    | sync (HSDP) seed7 | 2 | 1.2048 | 1.1485 | 1.1268 | 1.1127 | 1.1064 | +0.0000 | +0.0134  |    525,576 |
    | DiLoCo H=20       | 2 | 1.1953 | 1.1268 | 1.0970 | 1.0877 | 1.0825 | -0.0035 | +0.0058  |     26,278 |
    | DiLoCo H=20 seed7 | 2 | 1.2149 | 1.1521 | 1.1209 | 1.1077 | 1.1031 | -0.0033 | +0.0101  |     26,278 |
    | DiLoCo H=50       | 2 | 1.2122 | 1.1336 | 1.1100 | 1.1065 | 1.0912 | +0.0052 | +0.0146  |     10,511 |
    | DiLoCo H=50 seed7 | 2 | 1.2186 | 1.1578 | 1.1373 | 1.1281 | 1.1099 | +0.0035 | +0.0169  |     10,511 |
    | Stream. H=50 F=2  | 2 | 1.1724 | 1.1245 | 1.1017 | 1.0929 | 1.0855 | -0.0004 | +0.0089  |     10,511 |
    | DiLoCo H=50 int8  | 2 | 1.2122 | 1.1336 | 1.1101 | 1.1065 | 1.0912 | +0.0052 | +0.0146  |      5,346 |
    | sync (HSDP)       | 4 | 1.1853 | 1.1246 | 1.1049 | 1.0918 | 1.0859 | +0.0000 | +0.0093  |    525,576 |
    | DiLoCo H=20       | 4 | 1.1815 | 1.1184 | 1.0914 | 1.0843 | 1.0796 | -0.0063 | +0.0030  |     26,278 |
    | DiLoCo H=50       | 4 | 1.2133 | 1.1190 | 1.1109 | 1.1029 | 1.0838 | -0.0022 | +0.0071  |     10,511 |

    loss floor (entropy rate, per corpus seed): 1.0766, 1.0930 nats/token

Reading: at the same 2.05M tokens DiLoCo H=20 ends 0.003-0.006 nats *below* the synchronous run (2 replicas: -0.0035
and -0.0033 on two seeds; 4 replicas: -0.0063), H=50 within +0.005 (2 replicas: +0.0052 / +0.0035; 4 replicas:
-0.0022), streaming (F=2, H=50) -0.0004 and int8 the same as fp32 to 4 decimals (+0.0052), at 1/20 and 1/50 of the
replica-axis bytes (int8: 1/98; re-run 2026-11-25 after the exchange became an all-to-all of chunks). Early (0.4M
tokens) H=50 lags by ~0.03. One or two seeds per row: the seed-to-seed spread of a gap was up to 0.002 (two seeds),
so differences below that are noise. The sync rows at 2 and 4 replicas are bit-identical (same global batch and data
order; observed, not investigated).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[1] / "lightning_dist" / "conf"
VAL_EVERY = 100
GLOBAL_BATCH, SEQ_LEN = 32, 128

#: name -> (label, parallelism overrides); the replica count is added per run.
KINDS: dict[str, tuple[str, list[str]]] = {
    "sync": ("sync (HSDP)", ["parallelism=fsdp", "parallelism.dp_shard=1"]),
    "h20": ("DiLoCo H=20", ["parallelism=diloco", "parallelism.diloco.every=20"]),
    "h50": ("DiLoCo H=50", ["parallelism=diloco", "parallelism.diloco.every=50"]),
    "stream": ("Streaming H=50 F=2", ["parallelism=diloco", "parallelism.diloco.every=50",
                                      "parallelism.diloco.fragments=2"]),
    "int8": ("DiLoCo H=50 int8", ["parallelism=diloco", "parallelism.diloco.every=50",
                                  "parallelism.diloco.compression=int8"]),
}  # fmt: skip
#: Kinds run per replica count (4 replicas on 2 cores is slow: sync and plain DiLoCo only).
PER_REPLICAS = {2: ["sync", "h20", "h50", "stream", "int8"], 4: ["sync", "h20", "h50"]}


def compose(overrides: list[str], output_dir: Path) -> Any:
    """The config ``lightning-dist-train <overrides>`` would run (as ``tests/helpers.py`` composes it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.config.schema import register_configs, to_train_config

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_train_config(hydra_compose(config_name="train", overrides=overrides))
    cfg.output_dir = str(output_dir)
    return cfg


def run_one(kind: str, replicas: int, steps: int, out: Path, seed: int | None = None) -> dict[str, Any]:
    """Train one configuration; its val/loss per checkpoint, final losses, replica-axis bytes and wall time."""
    from lightning_dist.run.train import run

    label, parallelism = KINDS[kind]
    replicate = [f"parallelism.dp_replicate={replicas}"] if kind == "sync" else []
    suffix = f"_seed{seed}" if seed is not None else ""
    replicate += [f"seed={seed}"] if seed is not None else []
    overrides = [
        *parallelism, *replicate, f"cluster.devices={replicas}", "logger=csv", f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={VAL_EVERY}", "trainer.limit_val_batches=1.0", "trainer.num_sanity_val_steps=0",
        "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false", "telemetry.report=false",
        f"data.global_batch_size={GLOBAL_BATCH}", f"data.seq_len={SEQ_LEN}",
    ]  # fmt: skip
    began = time.perf_counter()
    result = run(compose(overrides, out / f"{kind}_{replicas}{suffix}"))
    wall = time.perf_counter() - began
    with Path(result.csv).open() as handle:
        rows = list(csv.DictReader(handle))
    val = {int(r["step"]) + 1: float(r["val/loss"]) for r in rows if r.get("val/loss")}  # CSV steps count from 0
    last = {k: float(v) for r in rows for k, v in r.items() if v not in ("", None) and k != "epoch"}
    train = [(int(h["step"]), h["train/loss"]) for h in result.history if "train/loss" in h]
    return {
        "name": f"{kind}_{replicas}{suffix}", "kind": kind, "label": label + suffix.replace("_", " "), "seed": seed,
        "replicas": replicas, "steps": steps, "tokens_per_step": GLOBAL_BATCH * SEQ_LEN, "val": val, "train": train,
        "val_loss": result.val_loss, "loss_floor": result.loss_floor, "wall_s": round(wall, 1),
        "replica_bytes_per_step": last.get("diloco/bytes_per_step") if kind != "sync" else last.get("comm/dp/bytes"),
        "outer_fraction": last.get("diloco/outer_fraction"),
    }  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: val/loss at each checkpoint (by tokens), the gap to the sync run of the same replica count and to
    the floor."""
    checkpoints = sorted({s for r in results for s in r["val"]})
    tokens = results[0]["tokens_per_step"]
    head = ["run", "replicas", *(f"{s * tokens / 1e6:.2f}M tok" for s in checkpoints), "final val/loss",
            "vs sync", "vs floor", "replica bytes/step", "wall s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    sync = {(r["replicas"], r.get("seed")): r for r in results if r["kind"] == "sync"}
    for r in results:
        base = sync.get((r["replicas"], r.get("seed")))
        gap = f"{r['val_loss'] - base['val_loss']:+.4f}" if base else "-"
        cells = [
            r["label"],
            str(r["replicas"]),
            *(f"{r['val'][s]:.4f}" if s in r["val"] else "-" for s in checkpoints),
            f"{r['val_loss']:.4f}",
            gap,
            f"{r['val_loss'] - r['loss_floor']:+.4f}",
            f"{r['replica_bytes_per_step']:,.0f}" if r["replica_bytes_per_step"] else "-",
            f"{r['wall_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    floors = sorted({f"{r['loss_floor']:.4f}" for r in results})
    lines.append(f"\nloss floor (entropy rate, per corpus seed): {', '.join(floors)} nats/token")
    return "\n".join(lines)


def write_comparison(results: list[dict[str, Any]], out: Path) -> Path:
    """The run report's comparison page (``compare.html``, ``compare_loss.png``) of the runs on the main corpus
    (another seed is another corpus, another floor): each run folder's ``report.json`` with the val/loss read from its
    CSV added to its history, labelled with the run's kind and replica count; sync at 2 replicas first (the gaps)."""
    from lightning_dist.telemetry.report import render_comparison

    runs = []
    for r in (r for r in results if r.get("seed") is None):
        data = json.loads((out / r["name"] / "report.json").read_text())
        by_step = {int(record["step"]): record for record in data["history"]}
        for step, loss in r["val"].items():
            by_step.setdefault(int(step), {"step": float(step)})["val/loss"] = loss
        data["history"] = [by_step[s] for s in sorted(by_step)]
        data["label"] = f"{r['label']}, {r['replicas']} replicas"
        data.setdefault("tokens_per_step", r["tokens_per_step"])
        runs.append(data)
    title = "DiLoCo against synchronous training: loss vs tokens on the Markov corpus"
    return render_comparison(out, runs, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only", default="", help="comma-separated run names (e.g. sync_2,h20_2); default all")
    parser.add_argument("--seed", type=int, default=None, help="another seed (model init, data order): the noise")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/diloco_quality"))
    parser.add_argument("--report-only", action="store_true", help="no training: the table and page from --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    results = {r["name"]: r for r in json.loads(saved.read_text())} if saved.exists() else {}
    only = set(filter(None, args.only.split(",")))
    for replicas in args.replicas:
        for kind in PER_REPLICAS[replicas]:
            name = f"{kind}_{replicas}" + (f"_seed{args.seed}" if args.seed is not None else "")
            if (only and name not in only) or args.report_only:
                continue
            results[name] = run_one(kind, replicas, args.steps, args.out, args.seed)
            for r in results.values():  # JSON keys are strings: back to ints after a reload
                r["val"] = {int(k): v for k, v in r["val"].items()}
            ordered = sorted(results.values(), key=lambda r: (r["replicas"], list(KINDS).index(r["kind"])))
            saved.write_text(json.dumps(ordered, indent=1) + "\n")  # after every run: a later failure keeps it
            print(f"{name}: final val/loss {results[name]['val_loss']:.4f} in {results[name]['wall_s']:.0f} s")
    ordered = sorted(results.values(), key=lambda r: (r["replicas"], list(KINDS).index(r["kind"])))
    for r in ordered:
        r["val"] = {int(k): v for k, v in r["val"].items()}
    markdown = table(ordered)
    (args.out / "results.md").write_text(markdown + "\n")
    print(markdown)
    print(write_comparison(ordered, args.out))


if __name__ == "__main__":
    main()
