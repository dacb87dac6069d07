# lightning-dist on a CUDA PyTorch image: the package with its extras, on the image's own CUDA build of torch.
#   docker build -t lightning-dist:0.4.0 .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/outputs lightning-dist:0.4.0 cluster=gpu
# The sbatch recipes run it on a cluster (recipes/slurm/*.sbatch: CONTAINER_IMAGE=... for pyxis / enroot,
# APPTAINER_IMAGE=... for apptainer; `apptainer build lightning-dist.sif docker-daemon://lightning-dist:0.4.0`).
# Another torch / CUDA: --build-arg BASE_IMAGE=pytorch/pytorch:<torch>-cuda<x.y>-cudnn9-runtime (torch >= 2.11).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# The extras (docs/get-started/install.md): app: Hydra, W&B, the console scripts; hf: transformers, datasets, peft,
# huggingface_hub, tokenizers; eval: lm-eval; float8 and qlora: torchao; ft: torchft; slurm: submitit; loggers:
# TensorBoard, MLflow.
ARG EXTRAS=app,hf,eval,float8,qlora,ft,slurm,loggers

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/lightning-dist
COPY pyproject.toml README.md LICENSE ./
COPY lightning_dist ./lightning_dist
# The image's torch is pinned as it is (a constraint), so resolving the extras never swaps in another CUDA build.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && pip install -c /tmp/torch-constraint.txt ".[${EXTRAS}]" \
    && rm /tmp/torch-constraint.txt \
    && lightning-dist-train --help > /dev/null

# Runs write to ./outputs of the working directory (mount it); W&B stays offline unless WANDB_API_KEY / WANDB_MODE is set.
WORKDIR /workspace
ENTRYPOINT ["lightning-dist-train"]
