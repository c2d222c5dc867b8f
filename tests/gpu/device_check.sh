#!/usr/bin/env bash
# The prepared device check (one GPU, under 8 minutes): CUDA exactness tests, cost curves of
# emoji16 (fp32) and a random LlamaGen-XL-shaped target (bf16), and ar vs adt throughput at
# 1, 4, 16, 64 images in flight, and ar / eagle2 / adt on the 32-layer stand-in (emoji16@32). Writes $OUT (default ./device_check)/{cuda_tests.txt,
# cost_curves.json,.md, throughput.json, throughput.txt, throughput_deep32.json,.txt}.
#   bash tests/gpu/device_check.sh            # on the GPU machine, from the project root
set -uo pipefail
OUT="${OUT:-device_check}"
PY="${PY:-python}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== CUDA exactness tests"
timeout 150 "$PY" -m pytest -q tests/gpu -s 2>&1 | tail -40 | tee "$OUT/cuda_tests.txt"
echo "== cost curves"
timeout 150 "$PY" -m jobs.bench --cost-curves --xl --device cuda --json "$OUT/cost_curves.json" 2>&1 | tee "$OUT/cost_curves.txt"
echo "== throughput ar vs adt"
timeout 180 "$PY" -m jobs.bench --throughput --methods ar,adt --batches 1,4,16,64 --temperatures 0,default \
    --min-images 16 --device cuda --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.txt"
echo "== throughput on the deep-target stand-in (emoji16 at the depth of a 32-layer target; same images)"
timeout 120 "$PY" -m jobs.bench --throughput --target-layers 32 --methods ar,eagle2,adt --batches 1,4 --temperatures 0,default \
    --min-images 8 --device cuda --json "$OUT/throughput_deep32.json" 2>&1 | tee "$OUT/throughput_deep32.txt"
