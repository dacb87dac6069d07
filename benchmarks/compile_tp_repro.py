"""Minimal reproduction: torch.compile of a tensor-parallel block fails in its backward (torch 2.13, CPU / gloo).

``python benchmarks/compile_tp_repro.py``: two gloo ranks, the built-in GPT's TP plan (with and without sequence
parallelism, loss parallel), each block compiled in place with ``fullgraph=True`` (and without: the same). The eager
step runs; the compiled one fails in DTensor's redistribute backward with ``AttributeError: 'Tensor' object has no
attribute '_local_tensor'`` (a gradient arrives as a plain Tensor; cf. pytorch/pytorch#173123). While it does,
``Parallelism.check`` refuses ``compile=true`` with ``tp > 1`` in one line (``parallel/options.py``).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, sequence_parallel: bool, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_dist.models.gpt import GPT, GPTConfig
    from lightning_dist.models.gpt_parallel import gpt_tensor_parallel_plan
    from lightning_dist.models.loss import token_loss
    from lightning_dist.parallel.tensor import apply_tensor_parallel

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
    mesh = init_device_mesh("cpu", (2,))
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        apply_tensor_parallel(model, mesh, gpt_tensor_parallel_plan("", sequence_parallel, loss_parallel=True))
        if compiled:
            for block in model.layers.values():
                block.compile(fullgraph=True)
        try:
            with loss_parallel():
                loss = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
            outcome = f"loss {loss.full_tensor().item():.6f}"
        except Exception as err:  # the reproduction's point: print what torch raises
            outcome = "".join(traceback.format_exception_only(err)).strip()
        if rank == 0:
            print(f"sequence_parallel={sequence_parallel} compiled={compiled}: {outcome}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    print("torch", torch.__version__)
    for port, sequence_parallel in ((29611, True), (29612, False)):
        mp.spawn(rank_main, args=(sequence_parallel, port), nprocs=2)


if __name__ == "__main__":
    main()
