# cloudtrain in a container, set up by the project's own `make setup` (requirements.txt with
# constraints.txt, the built-in model and data). Two uses:
#   locally:    docker build -t cloudtrain .
#               docker run --rm -v "$PWD/outputs:/opt/cloudtrain/outputs" cloudtrain make train ARGS="--max_train_samples 500"
#               docker run --rm cloudtrain cloudtrain plan --num_gpus 8 --gpu_memory_gb 24
#   SageMaker:  build for GPUs, push to ECR, and pass its URI to the launcher:
#               docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t cloudtrain:gpu .
#               python sagemaker/launch.py --image_uri <account>.dkr.ecr.<region>.amazonaws.com/cloudtrain:gpu ...
#   The launcher sends src/ as the job's code, and SageMaker's drivers run it with the python3, pip
#   and torchrun they find first on PATH: this image's virtual environment.
FROM python:3.11-slim

# Where torch comes from: the CPU build by default (small, runs anywhere); a CUDA index for GPU instances.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ENV PATH=/opt/cloudtrain/.venv/bin:$PATH CLOUDTRAIN_DATA_DIR=/opt/cloudtrain/data
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cloudtrain
COPY Makefile requirements.txt requirements-dev.txt constraints.txt ./
# The pinned torch first, from TORCH_INDEX; the dependencies then find it installed and add the rest
# (a layer of its own: a change to src/ does not reinstall them).
RUN python -m venv .venv \
 && .venv/bin/pip install --index-url "$TORCH_INDEX" -c constraints.txt torch \
 && make .venv/.installed
# cloudtrain itself (editable: the `cloudtrain` command), then the default model and data.
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY src/ src/
RUN make setup
COPY configs/ configs/

CMD ["make", "train"]
