#!/usr/bin/env bash
# Download the wheels the GPU machine's image lacks into .whl/ (git-ignored), for `run(carry=[".whl"])`;
# benchmarks/device.sh installs them with --no-deps into /tmp/site. The image has torch 2.11 + CUDA 13, Triton 3.6,
# pytest, hypothesis and transformers 5.17; about 49 MB in all (the device tool carries at most 64 MiB).
#   flashinfer-python + apache-tvm-ffi + nvidia-cudnn-frontend   FlashInfer's MLA (a decode peer, optional backend)
#   sgl-flash-mla      FlashMLA's SM90 decode (peer + optional backend); its metadata asks for torch>=2.14.1, so it
#                      must go in with --no-deps (it loads on 2.11: stable torch ABI)
#   transformers 5.24 + huggingface-hub + tokenizers + safetensors + typer   the families V3.2 / GLM-DSA need
#   expecttest         the GPU tests that import CPU test modules with snapshot tests
#
#   tools/device_wheels.sh latest   fills .whl-latest/ instead: the newest transformers the CPU machines install (5.25;
#   it caches hy_v4's latent where 5.24 caches per-head K / V) with what it needs beyond the image (huggingface-hub 2.4 and
#   its httpx2, kernels), plus FlashMLA and expecttest; no FlashInfer (the 64 MiB carry). Use:
#   run(carry=[".whl-latest"], command="WHEELS=.whl-latest bash benchmarks/device.sh kernels")
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
[ "${1:-}" = latest ] && dest=.whl-latest
mkdir -p "$dest"
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
if [ "$dest" = .whl-latest ]; then
  wheels=(sgl-flash-mla==1.0.0 transformers==5.25.0 huggingface-hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 truststore
          kernels==0.19.1 tomlkit tokenizers==0.23.3 safetensors==0.8.0 typer expecttest)
else
  wheels=(flashinfer-python==0.5.3 apache-tvm-ffi nvidia-cudnn-frontend sgl-flash-mla==1.0.0 transformers==5.24.0
          huggingface-hub==1.31.0 tokenizers==0.23.3 safetensors==0.8.0 typer expecttest)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$dest" "${wheels[@]}"
du -sh "$dest"
