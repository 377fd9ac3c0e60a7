# elastic-trainer image: the package and `elastic-train`, running as uid 10001 (not root).
#
#   docker build -t ghcr.io/elastic-trainer/elastic-trainer:0.1.0-cpu .                          # CPU torch
#   docker build --build-arg VARIANT=cuda -t ghcr.io/elastic-trainer/elastic-trainer:0.1.0-cuda .  # CUDA torch
#
# The Kubernetes manifests (k8s/) run it with a read-only root filesystem: everything written at
# run time goes to mounted volumes (/tmp, $HOME, /var/log/elastic-trainer, /checkpoints).
# No secret goes into the image: credentials come from Kubernetes Secrets at run time.
FROM python:3.11-slim

# cpu: torch's CPU-only build, torch==<version>+cpu (small, no CUDA libraries).
# cuda: torch==<version>, whose Linux wheels bundle CUDA 12 libraries; nodes need an NVIDIA driver.
# pip uses the indexes the build is given: pass yours with --build-arg PIP_INDEX_URL=... and/or
# --build-arg PIP_EXTRA_INDEX_URL=... (for the cpu variant, one that has torch's CPU builds). This
# file names no package index.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/trainer

# tini as pid 1: passes SIGTERM on to elastic-train and reaps orphans.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 trainer \
 && useradd --uid 10001 --gid 10001 --home-dir /home/trainer --create-home --shell /usr/sbin/nologin trainer

RUN case "$VARIANT" in \
      cpu)  pip install "torch==${TORCH_VERSION}+cpu" ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; \
    esac

WORKDIR /opt/elastic-trainer
COPY pyproject.toml README.md ./
COPY elastic_trainer ./elastic_trainer
# torch is already there and satisfies the package's requirement, so pip keeps this build of it.
RUN pip install ".[s3,hdf5]" \
 && python -c "import torch, elastic_trainer; print('torch', torch.__version__)" \
 && rm -rf /opt/elastic-trainer/build

USER 10001:10001
WORKDIR /home/trainer
ENTRYPOINT ["tini", "--"]
CMD ["elastic-train", "--help"]
