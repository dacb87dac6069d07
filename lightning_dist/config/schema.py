"""Typed schema of a training run, registered in Hydra's ConfigStore.

Each group of ``conf/`` (model, data, parallelism, cluster, trainer) is validated against one dataclass here, so an
unknown key or a wrong type fails at composition; loggers and callbacks are Lightning classes built from ``_target_``.
The string under each field is its help text: ``lightning-dist-train --help <group>`` and
docs/reference/config.md (:mod:`lightning_dist.run.help`) show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_dist.config.keys import unknown_key
from lightning_dist.config.trainer_args import typed_trainer
from lightning_dist.data.config import DataConfig
from lightning_dist.environment import hydra_run_dir, hydra_subdir
from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.models.lora_config import LoraConfig
from lightning_dist.models.optim_config import OptimConfig
from lightning_dist.parallel.options import Parallelism

#: The Hydra configs ship inside the package (``conf/`` at the repository root links here), so an installed wheel
#: finds them as an editable install does.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class SlurmConfig:
    """``cluster.launcher=slurm``: the job submitted with submitit (``pip install 'lightning-dist[slurm]'``). One
    task per device (``--ntasks-per-node = cluster.devices``), as Lightning's SLURM environment requires."""

    partition: str | None = None
    """sbatch --partition."""
    account: str | None = None
    """sbatch --account."""
    qos: str | None = None
    """sbatch --qos."""
    constraint: str | None = None
    """sbatch --constraint (e.g. h100)."""
    time_min: int = 60
    """Time limit in minutes (sbatch --time)."""
    cpus_per_task: int | None = None
    """sbatch --cpus-per-task; None = the cluster's default."""
    mem_gb: int | None = None
    """Memory per node in GB (sbatch --mem); None = the cluster's default."""
    gpus_per_node: int | None = None
    """sbatch --gpus-per-node (cluster=slurm: cluster.devices); None = none requested."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before srun (module load ..., source .venv/bin/activate)."""
    signal_delay_s: int = 120
    """A signal this long before the time limit (submitit: sbatch --signal=USR2@s): the job saves at the next step
    boundary, stops and is requeued."""
    requeue: bool = True
    """Requeue the job after a preemption or time-limit signal; it continues from its checkpoint."""
    additional: dict[str, Any] = field(default_factory=dict)
    """Other sbatch options, e.g. {mail-type: END}."""
    executor: str = "slurm"
    """slurm, or local (submitit's local executor: the same job as processes on this machine, for testing)."""
    dry_run: bool = False
    """Print the sbatch script and the layout per node; submit nothing."""


@dataclass
class ClusterConfig:
    """The hardware the job runs on, and who starts its processes."""

    accelerator: str = "cpu"
    """Lightning accelerator: cpu, gpu or auto (gpu where CUDA devices are visible, else cpu)."""
    devices: int = 2
    """Processes (devices) per node."""
    num_nodes: int = 1
    """Number of nodes; above 1, start the job with torchrun or SLURM (one launch per node)."""
    precision: str = "32-true"
    """Lightning precision: 32-true, 64-true, bf16-mixed, bf16-true."""
    process_group_backend: str | None = None
    """torch.distributed backend; None = gloo on CPU, nccl on CUDA."""
    collective_timeout_s: float = 600.0
    """A collective that waits this long ends the job (torch's process-group timeout); on NCCL the flight recorder
    then writes what every rank was doing to ``<run>/flight_recorder/`` (docs/how-to/failures.md)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for MFU; None = looked up from the GPU name (omitted on CPU)."""
    launcher: str = "local"
    """local (the app starts cluster.devices processes; several nodes: torchrun or srun per node) or slurm (the app
    submits the job: cluster.slurm)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """cluster.launcher=slurm: the job submitit submits (partition, account, time, setup lines, dry run)."""


@dataclass
class HardwareConfig:
    """A device and its links, for the planner (``hardware=h100_sxm``, ...; ``conf/hardware/``)."""

    name: str = "H100 SXM 80GB"
    """Shown in the plan."""
    peak_tflops: float = 989.4
    """Dense bf16 TFLOP/s of one device."""
    float8_tflops: float | None = None
    """Dense float8 TFLOP/s (parallelism.float8); None = 2 x peak_tflops (H100, H200, B200); 0 = no float8 matmuls
    (A100: torchao would emulate them)."""
    memory_gib: float = 79.6
    """Device memory as CUDA reports it."""
    gpus_per_node: int = 8
    """Devices joined by the fast intra-node links."""
    intra_node_gbps: float = 360.0
    """Achievable collective bus bandwidth inside a node, GB/s per device."""
    inter_node_gbps: float = 40.0
    """Achievable collective bus bandwidth between nodes, GB/s per device."""
    compute_efficiency: float = 0.55
    """Fraction of peak the model's matmuls reach (the step's compute time = FLOPs / (peak x this))."""
    context_gib: float = 1.0
    """Device memory the CUDA context and libraries take before training."""
    memory_tbps: float = 3.35
    """Device memory bandwidth, TB/s; the memory-bound share of a step scales with it (3.35: H100 SXM HBM3, where
    compute_efficiency is stated)."""


@dataclass
class PlanConfig:
    """``lightning-dist-plan``: which layouts to search and how to show them."""

    top: int = 10
    """Layouts shown in each group, synchronous then DiLoCo (the best by tokens/s per device among those that fit)."""
    format: str = "table"
    """table (rich, on the terminal) or json (every layout searched, one object each)."""
    micro_batches: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Micro batch sizes tried (samples per forward; under pp, per pipeline microbatch)."""
    max_pp: int = 16
    """Largest pipeline degree tried."""
    trace: bool = False
    """Also trace one rank of the best layout on the fake backend: its exact bytes and collectives of one step."""
    trace_memory: bool = False
    """With ``trace``: follow the traced step's tensors with torch's MemTracker for its peak (slower: minutes)."""
    show_all: bool = False
    """The table includes layouts that do not fit."""
    tokens: float | None = None
    """Token budget: print the cost curve (best sync and best DiLoCo layout per GPU count, time and cost to train
    this many tokens) instead of the ranked table."""
    price_per_gpu_hour: float | None = None
    """USD per GPU-hour for the cost curve (cost = hours x price x GPUs); None leaves the cost out."""
    gpus: list[int] = field(default_factory=list)
    """GPU counts of the cost curve; empty: one node (hardware.gpus_per_node), doubling up to 1024."""
    syncs: list[str] = field(default_factory=lambda: ["every_step", "diloco"])
    """How replicas agree, searched where dp_replicate > 1: every_step (DDP / HSDP), diloco (at parallelism.diloco's
    every / fragments / delay)."""
    diloco_compressions: list[str] = field(default_factory=lambda: ["fp32", "bf16", "int8"])
    """DiLoCo pseudo-gradient compressions searched."""


@dataclass
class TelemetryConfig:
    """What the run measures and reports (:class:`lightning_dist.Telemetry`; docs/concepts/telemetry.md)."""

    enabled: bool = True
    """Log perf/ (tokens/s, MFU), comm/<axis>/ (time, bytes, busbw) and memory/ with lightning_dist.Telemetry."""
    track_comm: bool = True
    """Count every collective per mesh axis and time a sample of the steps (comm/<axis>/); False leaves comm/ out."""
    comm_timing_every_n_steps: int | None = None
    """Time the collectives of one step in this many. None: every step on CUDA (events, no wait); elsewhere once
    per logging window, since a host timer must wait for each collective (a timed DDP step on CPU: +3-6%)."""
    report: bool = True
    """Write the run report (report.html and its PNGs) in the run folder at the end; report.json is always written."""


@dataclass
class ResilienceConfig:
    """What the run does when something goes wrong: a rank dies or hangs, a step's gradient is NaN / Inf."""

    max_restarts: int = 0
    """Restart a job whose rank died or hung, from its newest checkpoint in the same folder, up to this many times."""
    hang_timeout_s: float | None = None
    """End the job when a rank makes no optimizer step for this long; None = 5x the slowest step, at least 60 s
    (the first steps, validation and checkpoint saves are allowed 30 minutes)."""
    on_nonfinite: str = "stop"
    """A step whose gradient norm (so also loss) is NaN / Inf: stop the run with one line, or skip the update."""


@dataclass
class CheckpointConfig:
    """Checkpoints during the run (``<run dir>/checkpoints/step-<N>``, sharded for our layouts), each published only
    when complete; ``trainer.enable_checkpointing=false`` turns all of them off."""

    every_n_steps: int | None = None
    """Save every this many optimizer steps; None = not by steps."""
    every_n_minutes: float | None = None
    """Save once this much wall time has passed since the last save; None = not by time."""
    keep_last: int = 2
    """Published checkpoints kept (the newest); older ones are removed after a newer one is complete."""
    async_save: bool = False
    """Copy the state to host memory and write it in the background (DCP async_save); the step waits for the copy
    only. Mesh layouts (not parallelism=ddp)."""
    save_hf: bool = False
    """Also write HuggingFace safetensors (config.json, the tokenizer) into each checkpoint's hf/ folder, consolidated
    from every rank's slices (a LoRA run: its peft adapter folder), for lightning-dist-eval / -generate / sharing."""
    verify: str = "checksums"
    """How a checkpoint is checked before a run continues from it (resume, ckpt_path, restarts): checksums (each
    file's size and CRC-32 against the manifest written with it: the checkpoint is read once, ~0.3 s per GB from the
    page cache) or sizes (sizes only). A damaged checkpoint is skipped for the newest whole one."""


@dataclass
class DebugConfig:
    """Debugging aids (``debug=fdr|overfit|profile|memory`` sets these and the Trainer's own; docs/how-to/debug.md)."""

    profile: bool = False
    """Trace optimizer steps profile_from..profile_to with torch.profiler (CPU and CUDA activity, shapes, memory):
    one Chrome-trace JSON per rank in <run>/profile/, opened at https://ui.perfetto.dev."""
    profile_from: int = 5
    """The first step traced (1-based: the step trainer/global_step reads after it); the steps before warm up."""
    profile_to: int = 7
    """The last step traced."""
    memory: bool = False
    """CUDA memory history from the first step (every allocation, with its stack) and a snapshot of it per rank at the
    end and on an out-of-memory error, in <run>/memory/ (open at https://pytorch.org/memory_viz). CUDA only."""
    memory_max_entries: int = 100000
    """Allocation events the history keeps (the newest)."""

    def check(self, accelerator: str, max_steps: int) -> None:
        """One line before launch for a window that cannot be traced or a memory history without CUDA."""
        if self.profile and not 1 <= self.profile_from <= self.profile_to:
            raise ValueError(
                f"debug.profile_from={self.profile_from}, profile_to={self.profile_to}: need 1 <= from <= to."
            )
        if self.profile and 0 < max_steps < self.profile_to:
            raise ValueError(f"debug.profile_to={self.profile_to} is past trainer.max_steps={max_steps}; lower it.")
        if self.memory and accelerator != "gpu":
            raise ValueError(
                f"debug=memory records CUDA memory history; cluster.accelerator={accelerator} has none: use "
                "debug=profile (its trace has the CPU profiler's memory view) or cluster=gpu."
            )


@dataclass
class TargetConfig:
    """Your own class, built by Hydra from ``_target_`` (its import path) and its keyword arguments.

    ``model=custom model._target_=mypkg.MyModule +model.hidden=64`` (a LightningModule);
    ``data=custom data._target_=mypkg.MyDataModule +data.batch_size=8`` (a LightningDataModule).
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:

        return instantiate({"_target_": self.target, **self.kwargs})


@dataclass
class HFModelConfig:
    """A HuggingFace causal LM: built from a config (``model=hf model.config=...``: random weights), or pretrained
    (``model=hf model.pretrained=<folder or hub id>``: its config, and its weights read slice by slice)."""

    kind: str = "hf"
    """Always hf."""
    config: str | None = None
    """A built-in tiny config (tiny_llama, tiny_qwen2, tiny_mistral, tiny_gpt2) or a local directory / config.json;
    None = the pretrained folder's config.json, or tiny_llama without pretrained."""
    pretrained: str | None = None
    """Start from these weights: a local HuggingFace folder (config.json + *.safetensors) or a hub id
    (meta-llama/Llama-3.1-8B[@revision]) read from the HuggingFace cache (HF_HUB_CACHE / HF_HOME), downloaded there
    first by one process per node when it is not (HF_TOKEN for a gated repo; HF_HUB_OFFLINE=1: the cache only). Each
    rank reads only its slices once the layout is applied (as init_from does); ignored when the run continues from
    a checkpoint."""
    attn_implementation: str = "auto"
    """transformers' attention implementation: auto (the family's own choice: sdpa where it supports it, else eager),
    sdpa, eager, flash_attention_2 or flex_attention; one the family does not support is refused before launch."""
    allow_untested_family: bool = False
    """Run a family the family matrix does not list (a newer transformers; docs/reference/hf-families.md): its
    layouts were not checked against one process."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (LoRA, peft) trained on the frozen model: model.lora.rank=16 (0 = every weight trained)."""


@dataclass
class EvalConfig:
    """lm-evaluation-harness tasks run on the model during training (``eval.tasks=[hellaswag] eval.every_n_steps=500``),
    from each checkpoint's HuggingFace save (``checkpoint.save_hf=true``), logged as ``eval/<task>/<metric>``; after
    training: ``lightning-dist-eval RUN --tasks ...``."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (or of your include_path); [] = no evaluation during training."""
    every_n_steps: int | None = None
    """Evaluate the checkpoint of every step that is a multiple of this (a multiple of checkpoint.every_n_steps);
    None = checkpoint.every_n_steps."""
    limit: float | None = None
    """Examples per task (>= 1) or a fraction of each task (< 1); None = all."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; None = each task's default."""
    include_path: str | None = None
    """A folder of task YAML files of your own (a local dataset: dataset_path: json with data_files)."""
    batch_size: int = 8
    """lm-eval's batch size."""


@dataclass
class TrainConfig:
    """A whole training run. Compose from ``conf/train.yaml``; override any field on the command line."""

    model: Any = MISSING
    """The built-in GPT's fields (GPTConfig: model=gpt_tiny, ...), your LightningModule (TargetConfig: model=custom),
    or a HuggingFace causal LM (HFModelConfig: model=hf)."""
    data: Any = MISSING
    """The built-in data's fields (DataConfig: data=synthetic, text, tokens) or your DataModule (data=custom)."""
    parallelism: Parallelism = MISSING
    """The layout: degrees (dp_replicate, dp_shard, cp, tp, pp) and how each axis works. fsdp is FSDP2."""
    cluster: ClusterConfig = MISSING
    """The devices, nodes and precision, and who starts the processes (the app, torchrun, srun or SLURM)."""
    trainer: Any = MISSING
    """Lightning ``Trainer`` arguments (:class:`TrainerConfig`); any other ``Trainer`` argument passes through."""
    logger: dict[str, Any] = field(default_factory=dict)
    """Lightning loggers by name, each built from ``_target_`` and its arguments (``logger=wandb``, csv,
    tensorboard, mlflow, many, none; ``+logger.<name>._target_=...``). A ``save_dir`` left null is the run folder."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer: AdamW with linear warmup and cosine decay (the built-in models)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints during the run, published only when complete."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """What the run measures (perf/, comm/, memory/) and reports (report.html)."""
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    """Restarts, hang detection and non-finite steps."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """The device the planner assumes (conf/hardware/; training itself reads cluster.*)."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """lightning-dist-plan: which layouts to search and how to show them."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """lm-eval tasks during training, on each checkpoint's HuggingFace save (needs checkpoint.save_hf=true)."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Debugging aids: a profiler trace of chosen steps, CUDA memory snapshots (debug=fdr|overfit|profile|memory)."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Your Lightning callbacks by name, each built from ``_target_`` and its arguments: ``callbacks=best`` (the best
    ``val/loss`` checkpoint and early stopping), or ``+callbacks.stop._target_=lightning.pytorch.callbacks.EarlyStopping
    +callbacks.stop.monitor=val/loss``. A ``ModelCheckpoint`` without ``dirpath`` writes to ``<run>/best``."""
    seed: int = 1234
    """Seed for initialization, data order and dropout; same seed + global batch = same run on any layout."""
    objective: str = "val/loss"
    """What a Hydra sweep (``-m``) optimizes: the last value of this logged metric is the job's return value (NaN for
    a point that failed, which the sweep survives)."""
    ckpt_path: str | None = None
    """Start from this checkpoint (file or sharded folder) in a new run folder; 'last' = resume=auto."""
    resume: str | None = None
    """Continue a run in its own folder from its newest complete checkpoint: a run folder, or 'auto' (output_dir)."""
    resume_allow_changes: bool = False
    """Let a run that continues another (resume, ckpt_path=last, a checkpoint of output_dir) change what defines its
    data stream and learning rate: seed, data.* (global_batch_size included), optim.*, the LR schedule's length.
    Without it such a resume stops before launch with one line naming the changes."""
    init_from: str | None = None
    """Start a new run from these weights (a HuggingFace folder, or a checkpoint folder: weights only, a fresh
    optimizer); ignored when the run continues from a checkpoint (resume / ckpt_path / restarts). model=hf
    model.pretrained=<folder> sets it to that folder."""
    output_dir: str | None = None
    """Where logs, checkpoints and W&B files go; None = Hydra's run directory."""


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The typed run config from Hydra's composed ``cfg``: ``model`` and ``data`` become the dataclass they describe.

    Raises:
        ValueError: A key the schema does not have (``+model.n_layer=4``), or a field of the built-in model or data
            of the wrong type (one line naming it).
    """
    composed = OmegaConf.to_container(cfg, resolve=False)
    chosen = {group: _schema_of(composed.get(group) or {}, group) for group in ("model", "data")}
    mistyped = unknown_key(composed, TrainConfig, choices=chosen)
    if mistyped:
        raise ValueError(mistyped)
    train_cfg: TrainConfig = OmegaConf.to_object(OmegaConf.merge(cfg, {"model": None, "data": None}))
    train_cfg.model = _typed(cfg.model, "model", GPTConfig, HFModelConfig)
    train_cfg.data = _typed(cfg.data, "data", DataConfig, None)
    train_cfg.trainer = typed_trainer(OmegaConf.to_container(cfg.trainer, resolve=True))
    return train_cfg


def _schema_of(node: Any, group: str) -> type | None:
    """The dataclass the ``model`` / ``data`` node is built as; ``None`` for a class of the user's (``_target_``)."""
    if "_target_" in node:
        return None
    if group == "model":
        return HFModelConfig if node.get("kind") == "hf" else GPTConfig
    return DataConfig


def _typed(node: DictConfig, group: str, builtin: type, hf: type | None) -> Any:
    if "_target_" in node:
        kwargs = OmegaConf.to_container(node, resolve=True)
        return TargetConfig(target=str(kwargs.pop("_target_")), kwargs=kwargs)
    schema = hf if hf is not None and node.get("kind") == "hf" else builtin
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        raise ValueError(f"{group}.{key}: {str(err).splitlines()[0]}") from None


def register_configs() -> None:
    """Register the schemas so ``conf/`` YAML files can extend them (``defaults: [<group>_schema]``)."""
    if not OmegaConf.has_resolver("ld_run_dir"):  # hydra.run.dir: one folder for every rank, node and restart
        OmegaConf.register_new_resolver("ld_run_dir", hydra_run_dir, use_cache=True)
    if not OmegaConf.has_resolver("ld_hydra_subdir"):  # hydra.output_subdir: a resumed run's config beside the first
        OmegaConf.register_new_resolver("ld_hydra_subdir", hydra_subdir, use_cache=False)
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    # The built-in model and data options extend these (their YAML starts with `defaults: [<group>_schema]`), so
    # their fields are typed and complete; model=custom / data=custom are free-form (their class's arguments).
    store.store(group="model", name="model_schema", node=GPTConfig)
    store.store(group="model", name="hf_schema", node=HFModelConfig)
    store.store(group="data", name="data_schema", node=DataConfig)
    store.store(group="parallelism", name="parallelism_schema", node=Parallelism)
    store.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    store.store(group="hardware", name="hardware_schema", node=HardwareConfig)
