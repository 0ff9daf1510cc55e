# syntax=docker/dockerfile:1
# Trainer image of the real-node e2e tests: strata's client library, examples/train.py and
# e2e/small_trainer.py, WITHOUT torch: PyPI's default torch wheel is the CUDA build (gigabytes)
# and the CPU wheel index may be unreachable, so the tests mount a site-packages holding torch
# read-only and put it on PYTHONPATH. A trainer image for real use is examples/Dockerfile.
# Build from the repository root:  docker build -f e2e/node/trainer.Dockerfile -t strata-trainer .
ARG BASE_IMAGE=python:3.12.8-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/strata
COPY pyproject.toml README.md ./
COPY sidecar/strata sidecar/strata
COPY operator/strata_operator operator/strata_operator
RUN /opt/strata/bin/pip install --no-compile . \
    && /opt/strata/bin/python -c "import strata" \
    && ! /opt/strata/bin/python -c "import torch" 2>/dev/null

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="strata-trainer" \
      org.opencontainers.image.description="Strata e2e trainer (examples/train.py, e2e/small_trainer.py); torch comes from a mounted site-packages" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/strata/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/strata /opt/strata
COPY examples/train.py /app/train.py
COPY e2e/small_trainer.py /app/small_trainer.py
USER 65532:65532
ENTRYPOINT ["python", "/app/small_trainer.py"]
