#!/usr/bin/env bash
# The prepared device check (one GPU, under 8 minutes, each part time-boxed and checkpointed):
# CUDA exactness tests; ar / eagle2 / adt / jacobi throughput on the 32-layer stand-in (emoji16
# at the depth of a 32-layer target; same images) and on shipped emoji16 at 1, 4, 16, 64 images
# in flight; cost curves of emoji16 (fp32) and a random LlamaGen-XL-shaped target (bf16).
# Writes $OUT (default ./device_check)/{gpu,cuda_tests}.txt, throughput_deep32.{json,txt},
# throughput.{json,txt}, cost_curves.{json,txt}. A rerun resumes the throughput JSONs.
#   bash tests/gpu/device_check.sh            # on the GPU machine, from the project root
# A machine with no package index and a 64 MiB tree transfer needs the text encoder packed
# first (tests/gpu/pack_encoder.py; its images are compared within the run only) and pydantic
# as wheels in .whl/ (both folders git-ignored, carried). The 2026-12-04 run was, in one call:
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   PY=python3; source .dev/prep.sh; OUT=$OUT PY=python3 bash tests/gpu/device_check.sh
set -uo pipefail
OUT="${OUT:-device_check}"
PY="${PY:-python}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
echo "== CUDA exactness tests"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -s 2>&1 | tail -40 | tee "$OUT/cuda_tests.txt"
echo "== throughput on the deep-target stand-in (emoji16 at the depth of a 32-layer target; same images)"
timeout 190 "$PY" -m jobs.bench --throughput --target-layers 32 --methods ar,eagle2,adt,jacobi,eagle2@5x10x58 \
    --batches 1,4,16,64 --temperatures 0,default --min-images 4 --passes 1 --device cuda \
    --json "$OUT/throughput_deep32.json" 2>&1 | tee "$OUT/throughput_deep32.txt"
echo "== throughput on shipped emoji16"
timeout 100 "$PY" -m jobs.bench --throughput --methods ar,eagle2,adt,jacobi,eagle2@5x10x58 --batches 1,4,16,64 --temperatures 0,default \
    --min-images 8 --passes 1 --device cuda --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.txt"
echo "== cost curves"
timeout 50 "$PY" -m jobs.bench --cost-curves --xl --device cuda --json "$OUT/cost_curves.json" 2>&1 | tee "$OUT/cost_curves.txt"
