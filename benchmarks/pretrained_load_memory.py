"""Per-rank peak host memory while a pretrained HuggingFace model (>= 1B parameters) is loaded through the app:
``model=hf model.pretrained=<folder>`` under fsdp4 (4 CPU ranks, gloo) against one process.

Run by hand: ``.venv/bin/python benchmarks/pretrained_load_memory.py [--dir /tmp/pretrained-bench] [--step]``.

- The model: Llama-3.2-1B's shape (hidden 2048, 16 layers, MLP 8192, 32 heads / 8 key-value heads, vocabulary
  128256, tied embeddings: 1.236 B parameters) with random bf16 weights, written once as safetensors files of at most
  ``--shard-gb`` (default 1 GB, with their index) straight from the meta device, one tensor drawn at a time: the
  writer never holds more than one file's tensors, so a 24 GB machine suffices.
- Each rank runs the app's own path (``validate`` + ``fit``: the model built on the meta device, laid out, then each
  rank reads only its slices of the safetensors through ``InitWeights``) with ``cluster.precision=bf16-true`` (the
  parameters in the files' dtype), logger none, ``data.seq_len=8``; it stops before the first optimizer step
  (``--step``: after one tiny step, when gradients and AdamW's moments exist too).
- Peak = ``getrusage(RUSAGE_SELF).ru_maxrss`` in each rank at the first step's start (or after it), minus the same
  measured after the rank imported torch, Lightning, transformers and lightning_dist. glibc's mmap threshold is fixed
  at 64 KiB (``mallopt``, as ``tests/distributed/test_meta_init.py``) so freed buffers do not count.

Stated bound: a rank's peak after loading <= weights / N + C, C = (largest safetensors file) / N + 150 MiB: a rank
reads one file at a time through a memory map, and the pages of its slices count in its resident set until that file
is closed; the 150 MiB are the process group, DTensor / FSDP2 state, one slice in flight and allocator slack.

Measured 2026-11-24 (2-core CPU VM, torch 2.13.0+cpu, transformers 5.24, gloo; 2357 MiB of bf16 weights in 3 files,
the largest 933 MiB, so C = 233 + 150 MiB for fsdp4 and 933 + 150 MiB for one process), growth over the ~314 MiB
after imports:

  =============  ==================  =======================  ==========================  =========
  layout         parameters held     peak after loading       peak - held                 load time
  =============  ==================  =======================  ==========================  =========
  fsdp4, rank 0  589 MiB (1/4)       943 MiB                  354 MiB (<= 383)            6 s
  fsdp4, rank 1  589 MiB             954 MiB                  365 MiB                     6 s
  fsdp4, rank 2  589 MiB             947 MiB                  357 MiB                     6 s
  fsdp4, rank 3  589 MiB             883 MiB                  293 MiB                     6 s
  one process    2357 MiB            3320 MiB                 962 MiB (<= 1083)           3 s
  =============  ==================  =======================  ==========================  =========

So an fsdp4 rank peaks at 0.28 of one process (943-954 vs 3320 MiB). With ``--step`` (one optimizer step of 8
tokens), an fsdp4 rank peaks at 3240 MiB: its parameters, gradients and both AdamW moments (4 x 589 MiB) plus the
all-gathered tied embedding / head unit and its unsharded gradient (2 x 501 MiB) for the step.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MB = 2**20
LLAMA_1B = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 2048,
            "tie_word_embeddings": True, "rope_theta": 500000.0}  # fmt: skip


def write_model(folder: Path, shard_bytes: int) -> dict:
    """The model as a HuggingFace folder of bf16 safetensors, written tensor by tensor from the meta device."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**LLAMA_1B, dtype="bfloat16")
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    state = meta.state_dict()
    names = [name for name in state if not name.endswith("lm_head.weight")]  # tied: the embedding's
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:  # file boundaries first, so the files can be named "-of-N"
        nbytes = state[name].numel() * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            shape = state[name].shape
            if name.endswith("norm.weight"):
                tensors[name] = 1 + 0.1 * torch.randn(shape, generator=generator).to(torch.bfloat16)
            else:
                tensors[name] = (0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
            weight_map[name] = filename
            total += tensors[name].nbytes
        save_file(tensors, folder / filename, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(folder)
    params = sum(state[name].numel() for name in names)
    return {"params": params, "bytes": total, "files": len(shards)}


class PeakMemory:
    """Lightning callback (built in the rank): peak growth at the first step's start, and optionally after it."""

    def __new__(cls, baseline: int, step: bool):
        import lightning.pytorch as pl

        class _Peak(pl.Callback):
            def __init__(self) -> None:
                self.result: dict = {}

            def on_train_start(self, trainer, pl_module) -> None:  # the weights are read (InitWeights.on_fit_start)
                local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
                self.result["params_bytes"] = sum(t.numel() * t.element_size() for t in local)
                self.result["loaded_peak"] = _maxrss() - baseline
                if not step:
                    trainer.should_stop = True  # measured: no optimizer step

            def on_train_batch_end(self, trainer, *args) -> None:
                self.result["step_peak"] = _maxrss() - baseline

        return _Peak()


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _rank(cfg, step: bool) -> dict:
    import ctypes

    import transformers

    from lightning_dist.run.fit import fit

    _ = transformers.LlamaForCausalLM  # its (lazy) module imported before the baseline
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: RSS follows what is alive
    baseline = _maxrss()
    probe = PeakMemory(baseline, step)
    started = time.perf_counter()
    fit(cfg, callbacks=(probe,))
    return {**probe.result, "baseline": baseline, "seconds": time.perf_counter() - started}


def measure(folder: Path, devices: int, out: Path, step: bool) -> list[dict]:
    from helpers import compose_config

    from lightning_dist.run.launch import launch

    overrides = ["model=hf", f"model.pretrained={folder}", "parallelism=fsdp", f"cluster.devices={devices}",
                 "cluster.precision=bf16-true", "logger=none", "trainer.max_steps=1", "telemetry.report=false",
                 "trainer.enable_checkpointing=false", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0",
                 "telemetry.enabled=false", "data.seq_len=8", f"data.global_batch_size={devices}",
                 "data.num_train_samples=64", "data.num_val_samples=8"]  # fmt: skip
    return launch(_rank, devices, compose_config(overrides, out), step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pretrained-bench"))
    parser.add_argument("--shard-gb", type=float, default=1.0, help="largest safetensors file, GB")
    parser.add_argument("--step", action="store_true", help="also run one tiny optimizer step")
    parser.add_argument("--layouts", default="4,1", help="devices per run, e.g. 4,1")
    args = parser.parse_args()
    folder = args.dir / "llama-1b"
    if not (folder / "config.json").is_file():
        started = time.perf_counter()
        info = write_model(folder, int(args.shard_gb * 1e9))
        print(f"wrote {info['params'] / 1e9:.3f} B parameters, {info['bytes'] / MB:.0f} MiB in {info['files']} files "
              f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"weights {weights / MB:.0f} MiB, largest file {largest / MB:.0f} MiB", flush=True)
    for devices in (int(d) for d in args.layouts.split(",")):
        ranks = measure(folder, devices, args.dir / f"run-{devices}", args.step)
        share = weights / devices
        for rank, r in enumerate(ranks):
            line = (f"{'fsdp' + str(devices) if devices > 1 else 'one process'} rank {rank}: holds "
                    f"{r['params_bytes'] / MB:.0f} MiB (share {share / MB:.0f}), peak after loading "
                    f"{r['loaded_peak'] / MB:.0f} MiB = share + {(r['loaded_peak'] - share) / MB:.0f} MiB")  # fmt: skip
            if "step_peak" in r:
                line += f"; after one step {r['step_peak'] / MB:.0f} MiB"
            print(line + f" (baseline {r['baseline'] / MB:.0f} MiB, {r['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
