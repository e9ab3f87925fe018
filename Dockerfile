# syntax=docker/dockerfile:1
# The cluster image: Ray's official GPU image with vitpipe and its locked dependencies
# (requirements/cuda.txt) installed, so that nodes install nothing when they start.
# Build and push it with cluster/image.sh, which holds the image's name and tag.
# Ray and Python here must match the lock and that tag: tests/test_cluster_configs.py checks it.
#
# torch is PyPI's Linux build, which brings its own CUDA 13 libraries: nodes need an NVIDIA
# driver of release 580 or newer. The base image's CUDA 12.8 serves Ray's own GPU support.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
ARG CUDA_TAG=cu128

# Stage 1: every wheel the runtime needs, checked against the lock's hashes, and vitpipe's own,
# built here so that its build tools and sources stay out of the runtime.
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${CUDA_TAG} AS wheels
WORKDIR /home/ray/src
COPY --chown=ray:users requirements/cuda.txt requirements/cuda.txt
RUN pip wheel --no-cache-dir --only-binary :all: --require-hashes --wheel-dir /home/ray/wheels/deps \
    -r requirements/cuda.txt
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users vit vit
COPY --chown=ray:users pipelines pipelines
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /home/ray/wheels/vitpipe .

# Stage 2: the runtime, installed offline from those wheels; the wheels stay out of its layers.
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${CUDA_TAG}
ARG RAY_VERSION
RUN --mount=type=bind,from=wheels,source=/home/ray/wheels,target=/tmp/wheels \
    --mount=type=bind,source=requirements/cuda.txt,target=/tmp/cuda.txt \
    pip install --no-cache-dir --no-index --find-links /tmp/wheels/deps --require-hashes -r /tmp/cuda.txt \
    && pip install --no-cache-dir --no-index --no-deps /tmp/wheels/vitpipe/vitpipe-*.whl \
    && python -c "import ray, pipelines.cli; assert ray.__version__ == '${RAY_VERSION}', ray.__version__" \
    && vitpipe --help > /dev/null
# A RayJob's working directory: its entrypoint names specs by their path in the repository.
WORKDIR /home/ray/vitpipe
COPY --chown=ray:users pipelines/specs pipelines/specs
