"""Wall time from process start to exit: a 1-step run of ``lightning-dist-train`` vs torchrun with a plain script.

Run by hand: ``.venv/bin/python benchmarks/startup.py [--repeats 5] [--pyc env|cached] [--report-variant]``.

Commands, each timed from ``subprocess.run`` to its exit, run in turn ``--repeats`` times (the order rotated every
round, after one untimed round that warms the disk cache), in a temporary folder:

- ``app``: ``.venv/bin/lightning-dist-train`` with the default job (tiny GPT d64 L2, synthetic data, ddp on 2 CPU
  processes) made a 1-step run: ``trainer.max_steps=1 logger=none trainer.enable_checkpointing=false
  trainer.num_sanity_val_steps=0 trainer.limit_val_batches=0``, its folder ``hydra.run.dir=<tmp>/app-<n>``. The
  rest is the default, the run report (``report.json`` and ``report.html``) included.
- ``app, report=false`` (``--report-variant``): the same with ``telemetry.report=false`` (diagnostic).
- ``plain``: ``.venv/bin/torchrun --standalone --nproc_per_node 2`` running a script that inits gloo, builds the same
  GPT (``models/gpt.py``, loaded without the package's ``__init__``, which imports Lightning), wraps it in DDP and
  takes one AdamW step on a random batch of the default size (16 x 128 tokens per rank) with clipping, then
  destroys the process group. torchrun sets one thread per rank; so does the app's launcher on 2 cores.
- ``import ...``: ``python -c "import lightning_dist.run.train"`` (what the app imports before it starts),
  ``import lightning``, ``import torch``, and ``python -c pass``.

The table gives the median and the best of the repeats, and app / plain. ``--pyc``: ``env`` runs the children with
this environment as it is (here ``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__`` in the repository, so every
process compiles ``lightning_dist`` from source); ``cached`` gives them a bytecode cache of their own
(``PYTHONPYCACHEPREFIX`` in the temporary folder, filled by the untimed round), as an installed package has.

Results (2026-11-24, 2-core VM): docs/benchmarks.md, "Per-step overhead and start-up".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"
APP_OVERRIDES = [
    "trainer.max_steps=1",
    "logger=none",
    "trainer.enable_checkpointing=false",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
]

PLAIN_SCRIPT = '''"""One DDP training step of the default job's GPT, torch only (run by torchrun, 2 ranks)."""

import importlib
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def gpt_module(package_dir: str) -> types.ModuleType:
    # lightning_dist/__init__.py imports Lightning: stand-in packages let the model file load on its own.
    for name, sub in (("lightning_dist", ""), ("lightning_dist.models", "/models")):
        package = types.ModuleType(name)
        package.__path__ = [package_dir + sub]
        sys.modules[name] = package
    return importlib.import_module("lightning_dist.models.gpt")


def main() -> None:
    dist.init_process_group("gloo")
    gpt = gpt_module(sys.argv[1])
    # conf/model/gpt_tiny.yaml; conf/data/synthetic.yaml: global batch 32 x 128 tokens over 2 ranks.
    config = gpt.GPTConfig(arch="llama", vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2)
    model = gpt.GPT(config)
    model.init_weights(1234)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = torch.randint(0, 256, (16, 129), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def commands(tmp: Path, report_variant: bool) -> dict[str, list[str]]:
    """Name -> argv; ``{n}`` in an argument is replaced by the run's number (a fresh run folder each time)."""
    script = tmp / "plain_ddp_step.py"
    script.write_text(PLAIN_SCRIPT)
    python = str(BIN / "python")
    app = [str(BIN / "lightning-dist-train"), *APP_OVERRIDES]
    variants = {"app": [*app, f"hydra.run.dir={tmp}/app-{{n}}"]}
    if report_variant:
        variants["app, report=false"] = [*app, "telemetry.report=false", f"hydra.run.dir={tmp}/app-nr-{{n}}"]
    variants["plain"] = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(script)]
    variants["plain"].append(str(ROOT / "lightning_dist"))
    for module in ("lightning_dist.run.train", "lightning", "torch"):
        variants[f"import {module}"] = [python, "-c", f"import {module}"]
    variants["python -c pass"] = [python, "-c", "pass"]
    return variants


def child_env(tmp: Path, pyc: str) -> dict[str, str]:
    """The children's environment: as given (``env``), or with a bytecode cache of their own (``cached``)."""
    env = dict(os.environ)
    if pyc == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


def time_command(argv: list[str], n: int, cwd: Path, env: dict[str, str]) -> float:
    """Seconds from start to exit of ``argv``; raises with the end of its output when it fails."""
    argv = [arg.replace("{n}", str(n)) for arg in argv]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return elapsed


def measure(repeats: int, pyc: str = "env", report_variant: bool = False) -> dict[str, list[float]]:
    """Seconds per run of each command, ``repeats`` interleaved rounds after one untimed round."""
    with tempfile.TemporaryDirectory(prefix="startup-") as name:
        tmp = Path(name)
        variants = commands(tmp, report_variant)
        env = child_env(tmp, pyc)
        names = list(variants)
        times: dict[str, list[float]] = {v: [] for v in names}
        for r in range(repeats + 1):
            for v in names[r % len(names) :] + names[: r % len(names)]:
                elapsed = time_command(variants[v], r, tmp, env)
                if r > 0:  # round 0 warms the disk cache (and fills the bytecode cache under --pyc cached)
                    times[v].append(elapsed)
            print(f"round {r}/{repeats}{' (untimed)' if r == 0 else ''} done", file=sys.stderr, flush=True)
    return times


def pyc_note(pyc: str) -> str:
    """Whether the children compile ``lightning_dist`` from source."""
    if pyc == "cached":
        return "children use a bytecode cache of their own (PYTHONPYCACHEPREFIX)"
    cached = (ROOT / "lightning_dist" / "__pycache__").is_dir()
    flag = os.environ.get("PYTHONDONTWRITEBYTECODE") or "unset"
    return f"PYTHONDONTWRITEBYTECODE={flag}, lightning_dist bytecode cached: {'yes' if cached else 'no'}"


def report(times: dict[str, list[float]]) -> None:
    """Median and best seconds per command, and each one's ratio to the plain torchrun run."""
    plain = statistics.median(times["plain"])
    print("| command                          | median s | best s | runs s                        | / plain |")
    print("|----------------------------------|----------|--------|-------------------------------|---------|")
    for v, runs in times.items():
        median, listed = statistics.median(runs), " ".join(f"{t:.2f}" for t in runs)
        print(f"| {v:<32} | {median:8.2f} | {min(runs):6.2f} | {listed:<29} | {median / plain:7.2f} |")
    paired = statistics.median(a / p for a, p in zip(times["app"], times["plain"]))
    print(f"app / plain: {statistics.median(times['app']) / plain:.2f} (paired {paired:.2f}); target <= 1.30")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pyc", choices=("env", "cached"), default="env")
    parser.add_argument("--report-variant", action="store_true", help="also time the app with telemetry.report=false")
    args = parser.parse_args()
    times = measure(args.repeats, args.pyc, args.report_variant)
    print(f"{os.cpu_count()} CPUs; {pyc_note(args.pyc)}")
    report(times)


if __name__ == "__main__":
    main()
