"""Lightning's own CLI (``LightningCLI``) with lightning-dist's GPT, data, strategies and callbacks.

Every Trainer argument comes from the command line or a YAML file, as a LightningCLI user expects; the strategy is a
class path with its arguments::

    python examples/cli.py fit --trainer.max_steps=20 --trainer.accelerator=cpu --trainer.devices=2 \\
        --trainer.strategy=lightning_dist.TensorParallelStrategy --trainer.strategy.tp=2 \\
        --trainer.callbacks+=lightning_dist.callbacks.Preemption --model.model.d_model=64

(``lightning_dist.PipelineParallelStrategy --trainer.strategy.pp=2``, ``lightning_dist.MeshStrategy
--trainer.strategy.dp_shard=2 --trainer.strategy.tp=2`` work the same way; ``--print_config`` shows every field.)
Needs ``jsonargparse[signatures]`` (``pip install "lightning[pytorch-extra]"``). Tested by
``tests/test_cli_example.py``.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lightning_dist.data.datamodule import TokenDataModule
from lightning_dist.models.module import GPTModule


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (``None``: the command line)."""
    return LightningCLI(
        GPTModule,
        TokenDataModule,
        args=args,
        # TokenDataModule shards by data-parallel rank itself (tp / pp peers read the same batches).
        trainer_defaults={"use_distributed_sampler": False, "enable_model_summary": False},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
