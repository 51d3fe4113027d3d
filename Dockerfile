# The training image Kubernetes jobs run (conf/job/*.yaml `image:`; README "Launching"):
#   make image IMAGE=registry.example/ml/llmfoundry:v1 && docker push registry.example/ml/llmfoundry:v1
# The base ships CUDA, cuDNN, NCCL and torch at pyproject's floor (torch>=2.11); the project is
# installed over it without replacing that torch (a constraint pins the image's build). CUDA 12.8
# runs on drivers >= 570 and on Blackwell; for CUDA 13.0 (drivers >= 580):
#   docker build --build-arg BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime .
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE}

# What a cluster run needs: object stores (checkpoints, data, status files), experiment loggers,
# fp8 (torchao 0.17: the release for torch 2.11), MDS compression codecs, sweeps, Hugging Face
# sources. flash-attn (the `gpu` extra) builds against CUDA headers: a -devel base installs it.
ARG EXTRAS=s3,gcs,azure,wandb,tensorboard,fp8,compression,data
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Where job files expect the code (code.workdir's default).
WORKDIR /workspace/llmfoundry
COPY . .
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch.txt \
    && pip install -c /tmp/torch.txt "torchao>=0.17,<0.18" -e ".[${EXTRAS}]" \
    && python -c "import llmfoundry, torch; print('llmfoundry on torch', torch.__version__)" \
    && rm /tmp/torch.txt

# Runs need no root: they write their run folder (outputs/ here, or a URL) and caches in $HOME.
# A numeric USER, so that Kubernetes' runAsNonRoot can check it.
RUN useradd --create-home --uid 10001 trainer && chown -R 10001 /workspace/llmfoundry
USER 10001
ENV HOME=/home/trainer
CMD ["python", "scripts/train.py", "--help"]
