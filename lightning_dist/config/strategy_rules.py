"""Which ``parallelism.strategy`` can do which degrees and options: checked before any degree arithmetic, so the
message names the strategy and the fix rather than a world-size mismatch."""

from __future__ import annotations

import importlib.util
import socket
from urllib.parse import urlsplit

from lightning_dist.parallel.options import Parallelism

#: How long the pre-launch check waits for a Lighthouse to accept a connection.
CONNECT_TIMEOUT_S = 5.0

#: ``parallelism.strategy`` -> the degrees it cannot do, each with the fix. ``ddp`` is Lightning's DDPStrategy;
#: every other name is our MeshStrategy, whose path follows from the degrees alone.
CANNOT_DO: dict[str, dict[str, str]] = {
    "ddp": {
        "tp": "use parallelism=tp or parallelism=tp_fsdp for tensor parallelism",
        "pp": "use parallelism=pp (or parallelism=3d with tp) for pipelines",
        "dp_shard": "use parallelism=fsdp to shard",
        "cp": "use parallelism=fsdp (or tp, tp_fsdp) with parallelism.cp for context parallelism",
        "ep": "use parallelism=fsdp (or tp_fsdp, pp) with parallelism.ep for expert parallelism",
    },
    "fsdp": {
        "tp": "use parallelism=tp or parallelism=tp_fsdp for tensor parallelism",
        "pp": "use parallelism=pp (or parallelism=3d with tp) for pipelines",
    },
    "tensor_parallel": {"pp": "use parallelism=pp (or parallelism=3d with tp) for pipelines"},
    "pipeline_parallel": {},
}
DOES = {
    "ddp": "dp_replicate",
    "fsdp": "dp_shard (FSDP2), dp_replicate (HSDP), cp, ep",
    "tensor_parallel": "dp_replicate, dp_shard, cp, ep, tp",
    "pipeline_parallel": "dp_replicate, dp_shard, cp, ep, tp, pp",
}


def check_strategy_can_do(par: Parallelism, accelerator: str = "cpu") -> None:
    """Degrees the chosen strategy cannot do, named before any degree arithmetic muddles the message."""
    if par.sync == "diloco" and par.strategy == "ddp":
        raise ValueError(
            "parallelism.sync=diloco cannot run on Lightning's DDP (it averages gradients every step); use "
            "parallelism=diloco, or parallelism.strategy=fsdp (or tensor_parallel / pipeline_parallel) with it."
        )
    hook = par.ddp.comm_hook
    if hook is not None and par.strategy != "ddp":
        raise ValueError(
            f"parallelism.ddp.comm_hook={hook} is for parallelism=ddp; FSDP2 layouts halve their gradient bytes with "
            "parallelism.fsdp.reduce_dtype=bf16."
        )
    if hook == "bf16" and accelerator != "gpu":
        raise ValueError(
            f"parallelism.ddp.comm_hook=bf16 needs CUDA and NCCL 2.10+ (torch's rule) and cluster.accelerator is "
            f"{accelerator}; use parallelism.ddp.comm_hook=fp16 there."
        )
    if par.fsdp.reduce_dtype is not None and par.strategy == "ddp":
        raise ValueError(
            f"parallelism.fsdp.reduce_dtype={par.fsdp.reduce_dtype} is for FSDP2 layouts; parallelism=ddp compresses "
            "with parallelism.ddp.comm_hook=bf16 (or fp16, powersgd)."
        )
    if par.float8 != "off" and importlib.util.find_spec("torchao") is None:  # found, not imported (start-up)
        raise ValueError(
            f"parallelism.float8={par.float8} needs torchao; pip install 'lightning-dist[float8]', or set "
            "parallelism.float8=off."
        )
    if par.replicas.fault_tolerant:
        if par.strategy == "ddp":
            raise ValueError(
                "parallelism.replicas.recovery=torchft runs on the mesh strategies; parallelism=ddp is Lightning's "
                "DDP: use parallelism=fsdp with parallelism.dp_replicate=N (and dp_shard inside each group)."
            )
        if importlib.util.find_spec("torchft") is None:  # found, not imported (start-up)
            raise ValueError(
                "parallelism.replicas.recovery=torchft needs torchft: pip install 'lightning-dist[ft]', or set "
                "parallelism.replicas.recovery=restart."
            )
        if par.replicas.lighthouse is not None:
            check_reachable(par.replicas.lighthouse)
    cannot = CANNOT_DO[par.strategy]
    bad = [axis for axis in cannot if getattr(par, axis) > 1]
    if bad:
        values = " ".join(f"parallelism.{axis}={getattr(par, axis)}" for axis in bad)
        raise ValueError(
            f"{values} is not possible with parallelism.strategy={par.strategy} (it does {DOES[par.strategy]}); "
            f"{cannot[bad[0]]}."
        )
    if par.cp > 1:  # torch's ring attention is CUDA's: context.attention=torch is refused elsewhere
        par.context.resolve(accelerator)


def check_reachable(address: str) -> None:
    """A torchft Lighthouse's address (``http://host:port``) accepts a connection.

    Raises:
        ValueError: It does not, or it is no address (one line naming it and the fix).
    """
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.hostname is None or parts.port is None:
        raise ValueError(
            f"parallelism.replicas.lighthouse={address!r} is not an address; give http://<host>:<port> (the "
            "Lighthouse's --bind), or null for the app's own."
        )
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ValueError(
            f"parallelism.replicas.lighthouse={address} cannot be reached ({err.strerror or err}); start it "
            "(torchft_lighthouse --min_replicas N --bind [::]:<port>) or give null for the app's own."
        ) from None
