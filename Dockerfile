# elastic-trainer image: the package and `elastic-train`, running as uid 10001 (not root).
#
#   docker build -t ghcr.io/elastic-trainer/elastic-trainer:0.1.0-cpu .                                 # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu128 --build-arg PIP_EXTRA_INDEX_URL=<index with torch's
#                cu128 wheels> -t ghcr.io/elastic-trainer/elastic-trainer:0.1.0-cuda .                  # CUDA 12.8
#
# The Kubernetes manifests (k8s/) run it with a read-only root filesystem: everything written at
# run time goes to mounted volumes (/tmp, $HOME, /var/log/elastic-trainer, /checkpoints).
# No secret goes into the image: credentials come from Kubernetes Secrets at run time.
FROM python:3.11-slim

# TORCH_VARIANT, the torch wheel's local version: which build of torch==<version> goes in.
#   cpu       torch==<version>+cpu: small, no CUDA libraries.
#   cuNNN     torch==<version>+cuNNN (cu126, cu128, cu130, ... as your index serves them): that CUDA's
#             libraries are in the wheel; the node needs an NVIDIA driver at least as new as that
#             CUDA's (Linux): cu126 >= 560.28 (>= 525.60 with CUDA's minor-version compatibility),
#             cu128 >= 570.26 (>= 525.60 likewise; Blackwell GPUs need cu128 or newer), cu130 >= 580.
#             A driver too old for the build leaves torch without CUDA: the trainer then stops with
#             one line (--device cuda in the gpu overlay; docs/gpu.md), it never trains on the CPU.
#   default   torch==<version> as your index serves it unqualified (the Linux wheels on the public
#             index bundle one CUDA 12 build: check torch.version.cuda in the built image).
# pip uses the indexes the build is given: pass yours with --build-arg PIP_INDEX_URL=... and/or
# --build-arg PIP_EXTRA_INDEX_URL=... (one that has torch's +cpu or +cuNNN builds). This file names
# no package index.
ARG TORCH_VARIANT=cpu
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

# CUDA variants: the RDMA user libraries (libibverbs and its providers, librdmacm), which NCCL opens
# at run time for InfiniBand/RoCE; without them multi-node NCCL falls back to TCP sockets without an
# error (NCCL_DEBUG=INFO shows "NET/IB" when they are used, "NET/Socket" when not). The node still
# needs its RDMA devices passed to the pod (an RDMA device plugin) for them to be used.
RUN case "$TORCH_VARIANT" in \
      cpu)                 spec="torch==${TORCH_VERSION}+cpu" ;; \
      cu[0-9][0-9][0-9])   spec="torch==${TORCH_VERSION}+${TORCH_VARIANT}" ;; \
      default)             spec="torch==${TORCH_VERSION}" ;; \
      *) echo "TORCH_VARIANT must be cpu, cuNNN (cu126, cu128, ...) or default, got '$TORCH_VARIANT'" >&2; exit 2 ;; \
    esac \
 && if [ "$TORCH_VARIANT" != cpu ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 \
      && rm -rf /var/lib/apt/lists/* ; \
    fi \
 && pip install "$spec"

WORKDIR /opt/elastic-trainer
COPY pyproject.toml README.md ./
COPY elastic_trainer ./elastic_trainer
# torch is already there and satisfies the package's requirement, so pip keeps this build of it.
RUN pip install ".[s3,hdf5,stream]" \
 && python -c "import torch, elastic_trainer; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
 && rm -rf /opt/elastic-trainer/build

USER 10001:10001
WORKDIR /home/trainer
ENTRYPOINT ["tini", "--"]
CMD ["elastic-train", "--help"]
