#!/usr/bin/env bash
# The CUDA receipts (issue 15's GPU goal), as run on a lent H200 where nothing can be downloaded:
# moetray and llama.cpp's llama-server on the same GGUF file, every expert on the GPU and with
# experts offloaded (moetray's expert cache against llama.cpp's --n-cpu-moe), then the offloading
# engine's token identity and the link's bandwidth on CUDA. It expects, beside the repository:
#   .whl/        wheels of moetray's pure dependencies missing from that machine's image
#   .devcarry/   demo-shape/ (the demo's config and tokenizer: the model itself is built on the
#                machine as a seeded random-weight twin), llama-server.xz (llama.cpp built for
#                sm_90 from llama-cpp-python 0.3.36's vendored source) and lib/ (its libgomp)
# llama-server was built on the 2-core CPU box (no GPU, ~25 min) with nvcc 13.0, the cuBLAS headers and
# libraries of PyPI's nvidia-cublas 13.10 wheel and a stub libcuda.so (the 11 driver symbols ggml's VMM
# pool links; the machine's driver serves them at run time):
#   cmake -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
#     -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON \
#     -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
#   && ninja -C build-cuda llama-server && strip build-cuda/bin/llama-server && xz -6 (53 MB -> 27 MB)
# Receipts land in $OUT (MOETRAY_BENCH_DIR): peer-cuda.json, engine-cuda.json, bw-cuda.json;
# bench/gpu/profile_step.py profiles a served decode step on the same machine.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MOETRAY_BENCH_DIR="$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/moetray
export PYTHONPATH=/tmp/pkg:/tmp/site
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$(ls -d "$site"/nvidia/*/lib | tr '\n' ':')/usr/local/cuda/lib64:$PWD/.devcarry/lib"
xz -dc .devcarry/llama-server.xz > /tmp/llama-server && chmod +x /tmp/llama-server || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; lscpu | head -20
  python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
  /tmp/llama-server --version; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | tail -40; }
# 30 layers: --n-cpu-moe 15 keeps half of the layers' experts in host memory, 23 about three quarters.
step 400 python3 -m moetray.app.cli bench peer --twin .devcarry/demo-shape --types F16 --device cuda \
  --dtype bfloat16 --kv-tokens 8192 --threads 8 --tokens 64 --concurrency 1,4 \
  --llama-server /tmp/llama-server --llama-args "-ngl 99" --offload 50%:15,25%:23 \
  --receipt peer-cuda --workdir /tmp/peer --timeout 150
step 100 python3 -m moetray.app.cli bench engine --device cuda --skip-accelerate --tokens 16 --repeats 2 \
  --receipt engine-cuda
step 40 python3 -m moetray.app.cli bench bw --device cuda --seconds 1 --no-profile --receipt bw-cuda
for f in /tmp/moetray-peer-*/*.log; do echo "=== $f"; tail -30 "$f"; done > "$OUT/server-logs.txt" 2>&1
ls "$OUT"
