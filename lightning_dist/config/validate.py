"""The one validation pass: every check that can be made before any process starts, in one place.

:func:`validate` takes the composed config and returns a :class:`ValidRun`: a resolved copy of the config (what
depends on this machine and on the run folder settled, its ``parallelism`` options among it) and its
:class:`~lightning_dist.parallel_dims.ParallelDims`, built once and handed to every rank as they are. The input is
never changed. Each failure is one line naming the config field, its value and the fix; rules the strategy must
enforce at run time too (a user's own ``Trainer``) are written once, in
:class:`~lightning_dist.parallel.options.Parallelism` and ``ParallelDims``, and only called from here.

What only some configs need is imported by the check that needs it (a checkpoint to continue, files to read, a
tensor-parallel split, a HuggingFace config): the launcher checks a plain config without torch or Lightning, and
builds nothing the ranks build again (the synthetic corpus is theirs to make).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.utils import get_class

from lightning_dist import environment
from lightning_dist.config import cluster_rules
from lightning_dist.config.finetune import check_finetune, replicate_on_the_mesh
from lightning_dist.config.pretrained import resolve_pretrained
from lightning_dist.config.run_rules import check_run_fields
from lightning_dist.config.schema import HFModelConfig, TargetConfig, TrainConfig
from lightning_dist.config.shapes import check_hf_moe, hf_config, num_blocks, vocab_and_length
from lightning_dist.config.strategy_rules import CANNOT_DO, check_strategy_can_do
from lightning_dist.config.tp_plan import load_tp_plan
from lightning_dist.config.trainer_args import adopt_lightning_names
from lightning_dist.data.config import DataConfig, data_seed, per_rank_batch_size, validate_data_config
from lightning_dist.data.corpus import holds_tokenizer, load_tokenizer
from lightning_dist.hub import resolve_data_path
from lightning_dist.manifest import DATA_MANIFEST, manifest_problem
from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.models.hf_families import check_family
from lightning_dist.parallel.options import FROM_PEER, Parallelism
from lightning_dist.parallel_dims import DEGREES, ParallelDims


@dataclass(frozen=True)
class ValidRun:
    """A checked run: the resolved config and its layout; what :func:`validate` returns."""

    cfg: TrainConfig
    dims: ParallelDims

    @property
    def parallelism(self) -> Parallelism:
        """How the layout's axes work (the resolved ``parallelism`` group: plan loaded, microbatches set)."""
        return self.cfg.parallelism

    @property
    def layout(self) -> str:
        """One line naming the strategy and the degrees, e.g. ``tensor_parallel: dp_replicate=1 ... (world 4)``, and
        the replicas' sync when it is not every step (``; sync=diloco H=50``)."""
        par = self.cfg.parallelism
        sync = f"; sync=diloco H={par.diloco.every}" if par.sync == "diloco" else ""
        return f"{par.strategy}: {self.dims.describe()}{sync}"


def validate(cfg: TrainConfig, one_rank_here: bool = False) -> ValidRun:
    """Check ``cfg`` and return its resolved copy with its layout and options; ``cfg`` itself is not changed.

    ``one_rank_here``: this machine runs one rank of the layout (:mod:`lightning_dist.run.rehearse`), so its devices
    are not counted against ``cluster.devices``.

    Resolved: ``model.pretrained`` (a hub id into its cached folder, which ``init_from`` then names),
    ``cluster.accelerator=auto``, the progress bar (on at a terminal), ``resume`` / ``ckpt_path=last`` /
    an external restart into ``output_dir`` and ``ckpt_path``, ``parallelism=ddp`` for a run that needs a checkpoint
    folder (``checkpoint.save_hf``, QLoRA) into the mesh's replication (one line says so), and how each rank's batch is
    split (``data.micro_batch_size``, ``trainer.accumulate_grad_batches``, ``parallelism.pipeline.microbatches``).

    Raises:
        ValueError: One line naming the value and the fix.
    """
    cfg = copy.deepcopy(cfg)
    par, cluster, trainer = cfg.parallelism, cfg.cluster, cfg.trainer
    check_run_fields(cfg)
    resolve_pretrained(cfg)  # model.pretrained -> its local folder, which the run starts from (init_from)
    resolve_data_path(cfg.data)  # data=hf data.path=<hub dataset id> -> its local snapshot
    asked = f"resume={cfg.resume}" if cfg.resume is not None else f"ckpt_path={cfg.ckpt_path}"
    _rejoin_from_a_peer(cfg)
    if cfg.resume is None and cfg.ckpt_path not in ("last", FROM_PEER) and environment.restart_count() == 0:
        cluster_rules.check_new_run_folder(cfg.output_dir, cfg.ckpt_path)  # a new run never writes over another's
    if _continues_or_starts_from_weights(cfg):  # else it starts fresh in output_dir: no checkpoint to read
        # deferred: reading checkpoints and weights needs torch (test_layering: DEFERRED)
        from lightning_dist.config.start import resolve_start

        cfg.output_dir, cfg.ckpt_path = resolve_start(cfg)
    cfg.resume = None
    if par.strategy not in CANNOT_DO:
        raise ValueError(f"parallelism.strategy={par.strategy!r} is unknown; use one of {sorted(CANNOT_DO)}.")
    adopt_lightning_names(trainer, cluster)  # trainer.devices=4 is cluster.devices=4
    cluster.accelerator = cluster_rules.resolve_accelerator(cluster.accelerator)
    cluster_rules.adopt_launcher_sizes(cluster)
    if cluster.collective_timeout_s <= 0:
        raise ValueError(f"cluster.collective_timeout_s={cluster.collective_timeout_s} must be > 0 (seconds).")
    if cluster.launcher not in ("local", "slurm"):
        raise ValueError(f"cluster.launcher={cluster.launcher!r} is unknown; use local or slurm.")
    if cluster_rules.should_submit(cluster):
        cluster_rules.check_submission(cluster)  # the login node: its own hardware says nothing about compute nodes
    elif not one_rank_here:
        cluster_rules.check_devices(cluster.accelerator, cluster.devices, cluster.num_nodes)
    replaced = replicate_on_the_mesh(cfg)  # save_hf / QLoRA need a checkpoint folder, which DDP does not write
    if replaced is not None and environment.is_global_zero():  # one line per job (under torchrun every rank checks)
        print(replaced, file=sys.stderr, flush=True)
    par = cfg.parallelism
    check_strategy_can_do(par, cluster.accelerator)
    dims = build_parallel_dims(cfg)
    per_rank_batch = check_model_and_data(cfg, dims)
    split = split_batch(cfg, dims, per_rank_batch)
    if per_rank_batch is not None:  # the built-in data: it reads data.micro_batch_size
        cfg.data.micro_batch_size = split.micro_batch_size
    trainer.accumulate_grad_batches = split.accumulate_grad_batches
    plan = load_tp_plan(par.tensor.plan) if isinstance(par.tensor.plan, str) else par.tensor.plan
    cfg.parallelism = par = replace(
        par,
        pipeline=replace(par.pipeline, microbatches=split.microbatches),
        tensor=replace(par.tensor, plan=plan),
    )
    _check_layout(cfg, dims, per_rank_batch)
    if _continues_its_own_run(cfg):  # once resolved (micro batches, the tokenizer), as the checkpoint noted them
        # deferred: reading a checkpoint needs torch (test_layering: DEFERRED)
        from lightning_dist.config.start import check_unchanged

        check_unchanged(cfg, asked)
    if trainer.enable_progress_bar is None:
        # Lightning's (rich) bar for a person at a terminal; none in files and CI logs, where it is noise.
        trainer.enable_progress_bar = sys.stdout.isatty()
    return ValidRun(cfg=cfg, dims=dims)


def _continues_or_starts_from_weights(cfg: TrainConfig) -> bool:
    """Whether :func:`~lightning_dist.config.start.resolve_start` has anything to resolve: a checkpoint or weights
    named, or a torchrun / SLURM start that may be a restart of the job."""
    named = cfg.resume is not None or cfg.ckpt_path is not None or cfg.init_from is not None
    return named or environment.launcher() in ("torchrun", "slurm")


def _continues_its_own_run(cfg: TrainConfig) -> bool:
    """Whether the resolved run continues from a checkpoint of its own folder (resume, a restart, ckpt_path=last)."""
    if cfg.ckpt_path is None or cfg.output_dir is None:
        return False
    return Path(cfg.ckpt_path).resolve().parent == (Path(cfg.output_dir) / "checkpoints").resolve()


def _rejoin_from_a_peer(cfg: TrainConfig) -> None:
    """A replica group that torchrun / srun restarted (``recovery=torchft``) rejoins from a live peer's state, not its
    own newest checkpoint (older than the peers' step); ``ckpt_path=torchft:peer`` asks for it on any start.

    Raises:
        ValueError: ``ckpt_path=torchft:peer`` without ``recovery=torchft``, or with ``resume`` (one line).
    """
    replicas = cfg.parallelism.replicas
    if cfg.ckpt_path == FROM_PEER and not replicas.fault_tolerant:
        raise ValueError(
            f"ckpt_path={FROM_PEER} copies a live replica group's state, which needs "
            "parallelism.replicas.recovery=torchft; give a checkpoint path, or set the recovery."
        )
    if cfg.ckpt_path == FROM_PEER and cfg.resume is not None:
        raise ValueError(f"resume={cfg.resume} and ckpt_path={FROM_PEER}: set only one of them.")
    restarted = environment.restart_count() > 0 and environment.launcher() in ("torchrun", "slurm")
    if replicas.fault_tolerant and restarted and cfg.resume is None and cfg.ckpt_path is None:
        cfg.ckpt_path = FROM_PEER


def build_parallel_dims(cfg: TrainConfig) -> ParallelDims:
    """The layout of ``cfg`` over ``cluster.devices x cluster.num_nodes`` processes, validated. Under torchrun /
    srun with fault-tolerant replica groups each job is one group, so the whole job is ``dp_replicate`` of them."""
    par = cfg.parallelism
    degrees = {name: getattr(par, name) for name in DEGREES}
    external = environment.launcher() in ("torchrun", "slurm")
    groups = par.dp_replicate if par.replicas.fault_tolerant and external and par.dp_replicate > 1 else 1
    if groups > 1 and (par.replicas.group is None or par.replicas.lighthouse is None):
        raise ValueError(
            f"parallelism.replicas.recovery=torchft under {environment.launcher()}: each job is one of the "
            f"{groups} replica groups; give it parallelism.replicas.group=<0 .. {groups - 1}> and "
            "parallelism.replicas.lighthouse=http://<host>:<port> (torchft_lighthouse --min_replicas N)."
        )
    return ParallelDims(world_size=cfg.cluster.devices * cfg.cluster.num_nodes * groups, **degrees)


# ------------------------------------------------------------------------------------------------ the layout
def _check_layout(cfg: TrainConfig, dims: ParallelDims, per_rank_batch: int | None) -> None:
    """The layout against the model and the batch: tensor-parallel sizes, pipeline stages and microbatches.

    A user's own module is checked by the strategy when it is set up (its hooks name what is wrong).
    """
    par = cfg.parallelism
    if par.fsdp.cpu_offload and par.strategy == "ddp":
        raise ValueError(
            "parallelism.fsdp.cpu_offload=true with parallelism=ddp: offloading moves FSDP2 shards to host memory and "
            "Lightning's DDP holds none; use parallelism=fsdp."
        )
    par.check(dims, per_rank_batch=per_rank_batch if dims.pp_enabled else None)
    gpt = isinstance(cfg.model, GPTConfig)
    if gpt and dims.tp_enabled:
        # deferred: the GPT's tensor-parallel plan (torch's DTensor) is next to this rule (test_layering: DEFERRED)
        from lightning_dist.models.gpt_parallel import check_tensor_parallel

        check_tensor_parallel(cfg.model, dims.tp, getattr(cfg.data, "seq_len", None), par.tensor.sequence_parallel)
    if dims.cp_enabled:
        _check_context_parallel(cfg, dims, gpt)
    if dims.ep_enabled:
        _check_expert_parallel(cfg, dims, gpt)
    if isinstance(cfg.model, HFModelConfig):  # each layout of a HuggingFace family: exact, or refused here
        start = "pretrained" if cfg.model.pretrained is not None or cfg.init_from is not None else "init"
        check_hf_moe(hf_config(cfg.model), dims.ep)
        check_family(
            hf_config(cfg.model),
            {**dims.degrees, "ep": dims.ep},
            start,
            cfg.model.allow_untested_family,
            cfg.parallelism.loss_chunks,
        )
    if not dims.pp_enabled:
        return
    num_stages = dims.pp * par.pipeline.stages_per_rank
    blocks = num_blocks(cfg.model)
    if blocks is not None and num_stages > blocks:
        raise ValueError(
            f"parallelism.pp={dims.pp} x pipeline.stages_per_rank={par.pipeline.stages_per_rank} = {num_stages} stages "
            f"but the model has {blocks} blocks; lower pp / pipeline.stages_per_rank or use a model with more blocks."
        )
    if par.loss_chunks and isinstance(cfg.model, HFModelConfig):
        raise ValueError(
            f"parallelism.loss_chunks={par.loss_chunks} with parallelism.pp={dims.pp}: HFCausalLM's stages apply the "
            "head themselves (the chunked loss runs under pp for the built-in GPT); set parallelism.loss_chunks=0."
        )
    if gpt and cfg.model.tie_embeddings and dims.tp_enabled:
        raise ValueError(
            f"model.tie_embeddings=true with parallelism.pp={dims.pp} and parallelism.tp={dims.tp}: a weight tied "
            "across pipeline stages is not supported with tensor parallelism yet; untie it or use pp or tp alone."
        )


# --------------------------------------------------------------------------------------------- model and data
def _check_context_parallel(cfg: TrainConfig, dims: ParallelDims, gpt: bool) -> None:
    """The sequence split over cp: its length, the model's attention and a loss the split keeps exact."""
    seq_len = getattr(cfg.data, "seq_len", None)
    if seq_len is not None:
        dims.check_seq_len(seq_len)
    if isinstance(cfg.model, HFModelConfig):
        # deferred: next to HFCausalLM's context-parallel spec (test_layering: DEFERRED)
        from lightning_dist.models.hf_context import check_context_parallel as check_hf_context_parallel

        check_hf_context_parallel(hf_config(cfg.model), dims.cp)
    elif not gpt:
        raise ValueError(
            f"parallelism.cp={dims.cp} with model={_model_name(cfg)}: context parallelism supports the built-in GPT "
            "(arch=llama) and model=hf Llama / Qwen2 / Mistral; set parallelism.cp=1."
        )
    else:
        # deferred: next to the GPT's context-parallel spec (test_layering: DEFERRED)
        from lightning_dist.models.gpt_parallel import check_context_parallel

        check_context_parallel(cfg.model, dims.cp)
    if getattr(cfg.data, "format", "text") in ("instruction", "chat"):
        raise ValueError(
            f"parallelism.cp={dims.cp} with data.format={cfg.data.format}: a masked loss is normalized by the whole "
            "batch's token count, which the sequence split does not rescale yet; set parallelism.cp=1 or "
            "data.format=text."
        )


def _check_expert_parallel(cfg: TrainConfig, dims: ParallelDims, gpt: bool) -> None:
    """The experts split over ep: the GPT's MoE blocks (its rule, beside its config); a HuggingFace MoE family's are
    checked with its family (``check_hf_moe``), a user's model's by the strategy (its ``expert_parallel_spec()``)."""
    if gpt:
        cfg.model.moe.check_expert_parallel(dims.ep)


def _model_name(cfg: TrainConfig) -> str:
    model = cfg.model
    return "hf" if isinstance(model, HFModelConfig) else "custom" if isinstance(model, TargetConfig) else "gpt"


def check_model_and_data(cfg: TrainConfig, dims: ParallelDims) -> int | None:
    """Check the model and data against each other and the layout; return the per-rank batch when it is known."""
    model, data = cfg.model, cfg.data
    for group, node in (("model", model), ("data", data)):
        if isinstance(node, TargetConfig):
            _check_importable(group, node.target)
    if isinstance(model, GPTConfig):
        model.validate()
    if isinstance(model, (GPTConfig, HFModelConfig)):  # a user's module builds an optimizer of its own
        cfg.optim.validate()
    check_finetune(cfg, dims)  # model.lora, checkpoint.save_hf, eval.*
    vocab, max_len = vocab_and_length(model)
    if not isinstance(data, DataConfig):
        return None  # a user's DataModule: its loaders give per-rank batches (the global batch is dp x that)
    validate_data_config(data)  # the fields' own ranges first (global_batch_size=0 is not a divisibility problem)
    per_rank_batch = per_rank_batch_size(data.global_batch_size, dims.dp_size)
    if data.kind == "hf":
        _check_tokenizer(cfg, vocab)
    elif vocab is not None and data.vocab_size > vocab:
        raise ValueError(
            f"data.vocab_size={data.vocab_size} exceeds the model's vocabulary of {vocab}; "
            f"set model.vocab_size>={data.vocab_size} (or use a model with a larger vocabulary)."
        )
    if max_len is not None and data.seq_len > max_len:
        raise ValueError(
            f"data.seq_len={data.seq_len} exceeds model.max_seq_len={max_len}; "
            f"lower data.seq_len or raise model.max_seq_len."
        )
    data_seed(data, cfg.seed)
    if data.kind == "synthetic":
        return per_rank_batch  # made by each rank from the seed: validate_data_config has checked all it reads
    # deferred: the data module (torch, Lightning) is imported by the configs that read files (test_layering: DEFERRED)
    from lightning_dist.data.datamodule import TokenDataModule

    # Missing / empty / binary-as-text files fail here, before any rank starts; data=hf is tokenized and cached here,
    # once, so the ranks only open the cache.
    datamodule = TokenDataModule(data, seed=cfg.seed)
    datamodule.setup()
    check_data_files(data, datamodule)
    if not data.streaming:  # a batch to train on, a sample for each rank to validate (else found on the ranks)
        datamodule.check_split_size("train", dims.dp_size)
    if _validates(cfg.trainer) and (not data.streaming or data.val_path is not None):
        datamodule.check_split_size("val", dims.dp_size)
    if data.kind == "tokens":
        for split in ("train", "val"):
            dataset = datamodule.dataset(split)
            largest = dataset.max_token()
            if largest >= data.vocab_size:
                raise ValueError(
                    f"{str(dataset.file)!r} holds token id {largest}, beyond data.vocab_size={data.vocab_size}; set "
                    f"data.vocab_size (and model.vocab_size) above {largest}, or check data.token_dtype."
                )
    return per_rank_batch


def check_data_files(data: DataConfig, datamodule: Any) -> None:
    """The tokenized data a run reads is as it was written: ``data=tokens``' folder against the manifest
    ``lightning-dist-prepare`` wrote with it (a folder of another tool's has none: nothing to check it against), and a
    ``data=hf`` cache against its own (every cache has one since CACHE_VERSION 2). Each file's size and CRC-32: one
    read of the files, as ``data=tokens``' largest-token check reads them anyway.

    Raises:
        ValueError: A file missing, truncated, changed or added (one line naming it and the fix).
    """
    if data.kind == "tokens":
        folder = Path(data.path).expanduser()
        problem = manifest_problem(folder, name=DATA_MANIFEST) if (folder / DATA_MANIFEST).is_file() else None
        if problem is not None:
            raise ValueError(
                f"data.path={data.path} is damaged ({problem}); write it again with lightning-dist-prepare (its "
                "meta.json names the sources and tokenizer)."
            )
    elif data.kind == "hf":
        for split in ("train", "val"):
            try:
                folder = getattr(datamodule.dataset(split), "folder", None)
            except ValueError:  # data.streaming: train is a stream (no cache), val only with data.val_path
                continue
            problem = manifest_problem(folder, name=DATA_MANIFEST, unlisted=True)
            if problem is not None:
                raise ValueError(
                    f"the data=hf cache {folder} is damaged ({problem}); remove it (rm -r {folder}) and the next run "
                    "tokenizes the data again."
                )


def _validates(trainer: Any) -> bool:
    """Whether Lightning will read the validation data: a sanity check, or a validation before the run ends."""
    if trainer.limit_val_batches == 0:
        return False
    every = trainer.val_check_interval
    never = isinstance(every, int) and 0 < trainer.max_steps < every and not trainer.fast_dev_run
    return trainer.num_sanity_val_steps != 0 or not never


def _check_tokenizer(cfg: TrainConfig, vocab: int | None) -> None:
    """data=hf: ``data.tokenizer`` null = the model's own folder (``model.pretrained``, ``init_from`` or a
    ``model.config`` folder, the first that holds a tokenizer); its vocabulary must fit the model's."""
    data, model = cfg.data, cfg.model
    if data.tokenizer is None:
        hf = isinstance(model, HFModelConfig)
        folders = [model.pretrained, cfg.init_from, model.config] if hf else [cfg.init_from]
        data.tokenizer = next((str(folder) for folder in folders if holds_tokenizer(folder)), None)
    if data.tokenizer is None:
        raise ValueError(
            "data.tokenizer=null and the model has no folder with a tokenizer (model.pretrained / init_from / "
            "model.config); pass data.tokenizer=<the folder of the model's tokenizer>"
        )
    size = len(load_tokenizer(data.tokenizer))
    if vocab is not None and size > vocab:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} has {size} tokens, more than the model's vocabulary of {vocab}; use "
            f"the model's own tokenizer, or a model with a vocabulary of at least {size} (model.vocab_size)"
        )


@dataclass(frozen=True)
class BatchSplit:
    """How each rank's batch is split: micro batch size, Lightning's accumulation, and the pipeline's microbatches."""

    micro_batch_size: int | None
    accumulate_grad_batches: int
    microbatches: int | None


def split_batch(cfg: TrainConfig, dims: ParallelDims, per_rank_batch: int | None) -> BatchSplit:
    """How each rank's batch is split, from ``data.micro_batch_size`` or ``trainer.accumulate_grad_batches``.

    Without pp, the per-rank batch runs as ``per_rank / micro_batch_size`` forwards whose gradients Lightning
    accumulates (synced on the last one). Under pp the micro batches are the pipeline's microbatches, all run by the
    schedule in one training step (as Megatron does): accumulation is what a pipeline does already. With a user's
    DataModule a loader batch is one forward (under pp one schedule step) and Lightning accumulates
    ``accumulate_grad_batches`` of them. Resolving a resolved config gives the same split.
    """
    par, accumulate = cfg.parallelism, cfg.trainer.accumulate_grad_batches
    if accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate} must be >= 1.")
    microbatches = par.pipeline.microbatches
    unchanged = BatchSplit(getattr(cfg.data, "micro_batch_size", None), accumulate, microbatches)
    if per_rank_batch is None:  # a user's DataModule: its loader's batch is the micro batch (a schedule step, pp)
        return unchanged
    data, micro = cfg.data, cfg.data.micro_batch_size
    where = f"the per-rank batch {per_rank_batch} (data.global_batch_size={data.global_batch_size} / dp={dims.dp_size})"
    if micro is None:
        if per_rank_batch % accumulate:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate} does not divide {where}; use a divisor of it."
            )
        if accumulate == 1:
            return unchanged  # one forward per rank and step
        micro = per_rank_batch // accumulate
    if per_rank_batch % micro:
        raise ValueError(f"data.micro_batch_size={micro} does not divide {where}; use a divisor of it.")
    steps = per_rank_batch // micro
    if accumulate not in (1, steps):
        raise ValueError(
            f"trainer.accumulate_grad_batches={accumulate} contradicts data.micro_batch_size={micro} ({where} is "
            f"{steps} micro batches); set only data.micro_batch_size."
        )
    if not dims.pp_enabled:
        return BatchSplit(micro, steps, microbatches)
    if microbatches is not None and microbatches != steps:
        raise ValueError(
            f"parallelism.pipeline.microbatches={microbatches} contradicts data.micro_batch_size={micro} ({where} is "
            f"{steps} micro batches); set only one of them."
        )
    return BatchSplit(micro, 1, steps)


def _check_importable(group: str, target: str) -> None:
    try:
        get_class(target)
    except Exception as err:  # Hydra wraps the import error; its first line names the cause
        raise ValueError(
            f"{group}._target_={target!r} cannot be imported ({str(err).splitlines()[0]}); give the full import path "
            "of your class (package.module.Class) and make sure its package is installed or on PYTHONPATH."
        ) from None
