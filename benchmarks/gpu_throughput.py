"""Tokens/s of the app's training step against a plain torch loop of the same model, on one GPU (``make gpu-check``).

Run by hand: ``python benchmarks/gpu_throughput.py [--rows plain-gpt-eager app-gpt-fsdp-eager ...] [--steps 10]``;
``--smoke`` runs every row on the CPU with a tiny model (``tests/unit/test_gpu_check.py``: the script cannot break
unseen). Each row runs in a process of its own (a fresh CUDA context and allocator), prints one JSON line, and the
table compares each app row with the plain row of the same model and compile mode.

- ``plain``: no Lightning. The model class (the built-in ``GPT`` initialized by ``init_weights``, or transformers'
  ``LlamaForCausalLM`` of the same shape), bf16 autocast, ``AdamW(fused=True)``, ``clip_grad_norm_(1.0)``, the same
  float32 next-token loss (``models/loss.py: token_loss``); the batches made on the device beforehand.
- ``app``: :func:`lightning_dist.run.fit.fit`, what ``lightning-dist-train cluster=gpu`` runs on its one rank, with
  every default callback and the telemetry on; ``parallelism=fsdp`` (FSDP2, bf16 parameters, fp32 reductions) or
  ``ddp`` (Lightning's DDP, bf16 autocast); the synthetic corpus.
- compiled: every block ``torch.compile``d in place (``parallelism.compile=true``; the plain loop likewise).
- ``float8``: the blocks' linears in float8 (``parallelism.float8=tensorwise``, torchao), compiled, against bf16
  compiled; ``chunked-loss``: the head and loss in 8 pieces (``parallelism.loss_chunks=8``) against the whole loss,
  eager. Each app row also reports the step's peak device memory (``torch.cuda.max_memory_allocated``): the chunked
  row's against the eager bf16 row's is the logits' memory saved (the planner: 8192 tokens x 128256 x 10 bytes x
  7/8 = 8.6 GiB at this shape).

Timing: ``torch.cuda.synchronize`` at the end of step ``warmup`` and of step ``warmup + steps`` only, so the window
holds whole steps, logging steps included (``log_every_n_steps=10``: one in a 10-step window).
Shape: Llama-3.2-1B (1.24B parameters, 128K vocabulary, tied), sequence 2048, micro batch 4: 8,192 tokens a step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: name -> (runner, model, layout, compile)
ROWS: dict[str, tuple[str, str, str, bool]] = {
    "plain-gpt-eager": ("plain", "gpt", "", False),
    "plain-gpt-compiled": ("plain", "gpt", "", True),
    "app-gpt-fsdp-eager": ("app", "gpt", "fsdp", False),
    "app-gpt-fsdp-compiled": ("app", "gpt", "fsdp", True),
    "app-gpt-ddp-eager": ("app", "gpt", "ddp", False),
    "app-gpt-ddp-compiled": ("app", "gpt", "ddp", True),
    "plain-hf-eager": ("plain", "hf", "", False),
    "app-hf-fsdp-eager": ("app", "hf", "fsdp", False),
    "app-gpt-fsdp-float8-compiled": ("app", "gpt", "fsdp", True),
    "app-gpt-fsdp-chunked-loss-eager": ("app", "gpt", "fsdp", False),
}
#: name -> the options a row adds (issue 37), and the bf16 row it is compared with: float8 tensorwise (torchao)
#: compiled against bf16 compiled (tokens/s), the loss in 8 pieces against the whole loss (peak memory).
OPTIONS: dict[str, tuple[list[str], str]] = {
    "app-gpt-fsdp-float8-compiled": (["parallelism.float8=tensorwise"], "app-gpt-fsdp-compiled"),
    "app-gpt-fsdp-chunked-loss-eager": (["parallelism.loss_chunks=8"], "app-gpt-fsdp-eager"),
}
#: Llama-3.2-1B's shape, as conf/model/llama_1b.yaml.
SHAPE = {"vocab_size": 128256, "n_layers": 16, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 8192,
         "max_seq_len": 8192, "rope_theta": 500000.0, "tie_embeddings": True}  # fmt: skip
TINY = {"vocab_size": 256, "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
        "max_seq_len": 128, "rope_theta": 10000.0, "tie_embeddings": True}  # fmt: skip


def hf_config(shape: dict[str, Any]) -> Any:
    """transformers' Llama config of the built-in GPT's ``shape``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["d_model"], intermediate_size=shape["ffn_hidden"],
        num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"], max_position_embeddings=shape["max_seq_len"],
        rope_theta=shape["rope_theta"], tie_word_embeddings=shape["tie_embeddings"], rms_norm_eps=1e-5,
        attn_implementation="sdpa",
    )  # fmt: skip


def run_plain(model_kind: str, compile_: bool, shape: dict[str, Any], seq: int, micro: int, warmup: int,
              steps: int, device: str) -> dict[str, Any]:  # fmt: skip
    """The plain loop; returns seconds per step over the timed window and the last loss."""
    import torch

    from lightning_dist.models.gpt import GPT, GPTConfig
    from lightning_dist.models.loss import token_loss

    torch.manual_seed(0)
    if model_kind == "gpt":
        model = GPT(GPTConfig(**shape)).to(device)
        blocks = list(model.layers.values())
        forward = model
    else:
        from transformers import LlamaForCausalLM

        with torch.device(device):
            model = LlamaForCausalLM(hf_config(shape))
        blocks = list(model.model.layers)

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            return model(input_ids=tokens, use_cache=False).logits

    if compile_:
        for block in blocks:
            block.compile()
    cuda = device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda)
    tokens = torch.randint(0, shape["vocab_size"], (warmup + steps, micro, seq + 1), device=device)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(cuda)
            start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = token_loss(forward(tokens[step, :, :-1]), tokens[step, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(cuda)
    return {"s_per_step": (time.perf_counter() - start) / steps, "loss": float(loss)}


def run_app(model_kind: str, layout: str, compile_: bool, shape: dict[str, Any], seq: int, micro: int, warmup: int,
            steps: int, device: str, folder: str, options: list[str] = ()) -> dict[str, Any]:  # fmt: skip
    """The app's rank path (``fit``) with a clock at two step ends; returns seconds per step over the window."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir

    from lightning_dist.config.schema import register_configs, to_train_config
    from lightning_dist.run.fit import fit

    cuda = device == "cuda"
    if model_kind == "gpt":
        model = ["model=llama_1b", *(f"model.{k}={v}" for k, v in shape.items())]
    else:
        hf_config(shape).save_pretrained(f"{folder}/hf_config")
        model = ["model=hf", f"model.config={folder}/hf_config"]
    overrides = [
        *model, f"parallelism={layout}", f"parallelism.compile={str(compile_).lower()}",
        "cluster=gpu" if cuda else "cluster=local_cpu", "cluster.devices=1", "logger=none",
        "trainer.enable_checkpointing=false", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0",
        f"trainer.max_steps={warmup + steps}", "trainer.enable_progress_bar=false", "telemetry.report=false",
        f"data.seq_len={seq}", f"data.global_batch_size={micro}", f"data.num_train_samples={micro * (warmup + steps)}",
        f"output_dir={folder}/run", *options,
    ]  # fmt: skip
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "lightning_dist" / "conf"), version_base="1.3"):
        cfg = to_train_config(compose(config_name="train", overrides=overrides))

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: dict[int, float] = {}

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step in (warmup, warmup + steps):
                _sync(cuda)
                self.times[trainer.global_step] = time.perf_counter()

    clock = Clock()
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    result = fit(cfg, callbacks=[clock])
    seconds = clock.times[warmup + steps] - clock.times[warmup]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"s_per_step": seconds / steps, "loss": result.train_loss, "peak_gib": peak}


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def one_row(name: str, smoke: bool, steps: int) -> dict[str, Any]:
    """Run row ``name`` in this process; its tokens/s and MFU."""
    import torch

    from lightning_dist.models.gpt import GPT, GPTConfig

    runner, model_kind, layout, compile_ = ROWS[name]
    device = "cpu" if smoke else "cuda"
    shape, seq, micro = (TINY, 64, 2) if smoke else (SHAPE, 2048, 4)
    warmup = (5 if compile_ else 3) if not smoke else 1
    steps = 2 if smoke else steps
    with tempfile.TemporaryDirectory() as folder:
        if runner == "plain":
            measured = run_plain(model_kind, compile_, shape, seq, micro, warmup, steps, device)
        else:
            measured = run_app(model_kind, layout, compile_, shape, seq, micro, warmup, steps, device, folder,
                               OPTIONS.get(name, ([], ""))[0])  # fmt: skip
    tokens_per_s = seq * micro / measured["s_per_step"]
    with torch.device("meta"):
        flops = GPT(GPTConfig(**shape)).flops_per_token(seq)
    peak = 989.4e12 if device == "cuda" else None  # H100 / H200 SXM dense bf16
    return {"row": name, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / peak if peak else None,
            "loss": measured["loss"], "peak_gib": measured.get("peak_gib")}  # fmt: skip


#: Variables a launcher (torchrun, Lightning, SLURM) sets for its ranks; a row's own launch picks its own.
LAUNCHER_VARS = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID"}  # fmt: skip


def run_rows(names: list[str], smoke: bool, steps: int, timeout_s: float) -> list[dict[str, Any]]:
    """Each row in a fresh process; a row that fails or runs out of time is one line in the table."""
    results = []
    for name in names:
        row = _run_row(name, smoke, steps, timeout_s)
        for _ in range(3):  # its store's free port taken by another job between the pick and the bind: again
            if "EADDRINUSE" not in row.get("error", ""):
                break
            row = _run_row(name, smoke, steps, timeout_s)
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def _run_row(name: str, smoke: bool, steps: int, timeout_s: float) -> dict[str, Any]:
    """Row ``name`` in a fresh process: its result, or its error in one line."""
    command = [sys.executable, __file__, "--row", name, "--steps", str(steps), *(["--smoke"] if smoke else [])]
    started = time.perf_counter()
    try:
        path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        # A row is a job of its own: no launcher's rendezvous (a MASTER_PORT another job's store holds) is inherited
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"PYTHONPATH": path}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
            "row": name, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}  # fmt: skip
    except subprocess.TimeoutExpired:
        row = {"row": name, "error": f"timed out after {timeout_s:.0f} s"}
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: tokens/s, app / plain of the same model and compile mode, MFU."""
    by_name = {r["row"]: r for r in results}
    lines = ["| run | tokens/s | vs plain | vs its bf16 row | MFU (bf16 peak) | peak GiB | wall s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error']} | | | | | {r['wall_s']} |")
            continue
        runner, model_kind, _, compile_ = ROWS[r["row"]]
        plain = by_name.get(f"plain-{model_kind}-{'compiled' if compile_ else 'eager'}")
        if model_kind == "hf" and plain is None:
            plain = by_name.get("plain-gpt-eager")  # the HF row: against the plain GPT loop
        ratio = r["tokens_per_s"] / plain["tokens_per_s"] if plain and "tokens_per_s" in plain else None
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        shown = f"{ratio:.3f}" if ratio is not None and runner == "app" else "1" if runner == "plain" else "-"
        bf16 = by_name.get(OPTIONS[r["row"]][1]) if r["row"] in OPTIONS else None
        against = f"{r['tokens_per_s'] / bf16['tokens_per_s']:.3f}" if bf16 and "tokens_per_s" in bf16 else "-"
        peak_gib = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(f"| {r['row']} | {r['tokens_per_s']:,.0f} | {shown} | {against} | {mfu} | {peak_gib} | "
                     f"{r['wall_s']} |")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--row", choices=list(ROWS), help="run one row in this process (the script's own use)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, not speed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per row")
    args = parser.parse_args()
    if args.row:
        print(json.dumps(one_row(args.row, args.smoke, args.steps)), flush=True)
        return
    print("\n".join(table(run_rows(args.rows, args.smoke, args.steps, args.timeout))))


if __name__ == "__main__":
    main()
