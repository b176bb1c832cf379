# syntax=docker/dockerfile:1
# One image for every Apiary process: the API (`apiary serve`), the migration step (`apiary db upgrade`)
# and the Ray head and workers (`ray start`), because the trainers run on the Ray nodes: Apiary with its
# `server` and `cluster` extras (pyproject.toml). APIARY_EXTRAS=server builds an API-only image (no
# torch), for an API that reaches a Ray cluster built from the full one (APIARY_RAY_ADDRESS).
#
#   docker build -t apiary .                                   # CPU torch
#   docker build -t apiary:cu128 --build-arg TORCH_VARIANT=cu128 .   # CUDA 12.8 torch wheel
#
# TORCH_INDEX_URL overrides the wheel index altogether (a mirror, another CUDA build).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
# Keep TORCH_VERSION equal to pyproject.toml's torch pin (tests/unit/test_deploy.py checks it).
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG APIARY_EXTRAS=server,cluster
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/apiary
ENV PATH=/opt/apiary/bin:$PATH
# torch first, from its own index, in a layer that survives changes to Apiary's code (only for an image
# with the cluster's extra).
RUN case ",${APIARY_EXTRAS}," in *,cluster,*) \
      pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}";; esac
WORKDIR /src
COPY pyproject.toml README.md ./
COPY apiary ./apiary
COPY api ./api
COPY service ./service
COPY trainers ./trainers
COPY migrations ./migrations
RUN pip install ".[${APIARY_EXTRAS}]"

FROM python:${PYTHON_VERSION}-slim AS runtime
RUN useradd --create-home --uid 1000 apiary \
 && mkdir -p /var/lib/apiary \
 && chown apiary:apiary /var/lib/apiary
COPY --from=build /opt/apiary /opt/apiary
ENV PATH=/opt/apiary/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    APIARY_DATA_DIR=/var/lib/apiary \
    APIARY_HOST=0.0.0.0
USER apiary
WORKDIR /home/apiary
EXPOSE 8000
# The API's; compose sets each service's own (Ray nodes: Ray's health endpoints).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=3)"]
CMD ["apiary", "serve"]
