# GPU image for cluster runs: NVIDIA's PyTorch container already ships CUDA torch and
# Transformer Engine, so lptrain installs on top without touching torch.
ARG BASE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE}
WORKDIR /opt/lptrain
COPY pyproject.toml README.md ./
COPY lptrain ./lptrain
COPY configs ./configs
COPY recipes ./recipes
COPY scripts ./scripts
RUN pip install --no-cache-dir -e ".[dev]" && python -c "import lptrain, transformer_engine.pytorch"
ENV PYTORCH_ALLOC_CONF=expandable_segments:True
ENTRYPOINT ["lptrain"]
CMD ["--help"]
