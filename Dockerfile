# GPU image for cluster runs. NVIDIA's PyTorch container already ships CUDA torch, NCCL and
# Transformer Engine, so lptrain installs on top of them; the build fails if pip replaced the
# base image's torch. The base is pinned by tag: bump it deliberately, then rerun the GPU tests
# inside the new image.
#   docker build -t lptrain:0.1 .
#   docker run --gpus all --rm lptrain:0.1 validate-config --recipe mxfp8_muon.yaml
ARG BASE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE}

WORKDIR /opt/lptrain
ENV PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True

COPY pyproject.toml README.md Makefile ./
COPY lptrain ./lptrain
COPY configs ./configs
COPY recipes ./recipes
COPY scripts ./scripts
COPY docs ./docs
COPY tests ./tests
COPY bench ./bench
# Editable install: recipes/ and configs/ stay next to the package, as in a checkout. The
# checks fail the build when pip swapped torch or Transformer Engine is missing.
RUN TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')" \
    && pip install --no-cache-dir -e ".[dev]" \
    && test "$(python -c 'import torch; print(torch.__version__)')" = "$TORCH_BEFORE" \
    && python -c "import lptrain.cli, transformer_engine.pytorch" \
    && lptrain rules > /dev/null

ENTRYPOINT ["lptrain"]
CMD ["--help"]
