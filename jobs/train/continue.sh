#!/usr/bin/env bash
# Continue the emoji16 training on a fresh machine (sessions do not keep runs/ or data/).
#
#   bash jobs/train/continue.sh          # rebuild data, restore snapshots, restart unfinished runs
#
# Steps, each skipped when its output exists:
#   1. data/emoji from the npm package (jobs.train.data)
#   2. runs/<name>/ckpt.pt from train_state/<name> (jobs.train.snapshot restore)
#   3. runs/tokenizer/codes: the frozen image -> token map (identical encoder and codebook)
#   4. tokens + MiniLM caption states (jobs.train.tokenize; captions take ~13 min on one thread)
#   5. background runs (setsid nohup, one torch thread each): tokenizer decoder refinement and the
#      target while unfinished; the drafter once the target has finished.
# Before a session ends: `python -m jobs.train.snapshot save runs/<name> train_state/<name>`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
TOK_STEPS=3000
TARGET_STEPS=3000
DRAFTER_STEPS=1500

[ -f data/emoji/train_images.npy ] || $PY -m jobs.train.data --out data/emoji
for name in tokenizer target drafter; do
  if [ -d "train_state/$name" ] && [ ! -f "runs/$name/ckpt.pt" ]; then
    $PY -m jobs.train.snapshot restore "train_state/$name" "runs/$name"
  fi
done
if [ -d train_state/tokenizer_final ] && [ ! -d runs/tokenizer/final ]; then
  mkdir -p runs/tokenizer/final && cp train_state/tokenizer_final/* runs/tokenizer/final/
fi
if [ ! -f runs/tokenizer/codes/model.safetensors ]; then
  $PY -m jobs.train.tokenizer --data data/emoji --out runs/tokenizer --export-only --export runs/tokenizer/codes
fi
[ -f data/emoji/tokens_train.npy ] && [ -f data/emoji/captions_train.npz ] || \
  $PY -m jobs.train.tokenize --data data/emoji --tokenizer runs/tokenizer/codes --threads 1

step_of() {  # step in runs/$1/ckpt.pt, 0 when absent
  [ -f "runs/$1/ckpt.pt" ] || { echo 0; return; }
  $PY -c "import torch,sys; print(torch.load(sys.argv[1], map_location='cpu', weights_only=True)['step'])" "runs/$1/ckpt.pt"
}
start() {  # start <name> <args...>: a detached run that survives this shell
  local name=$1; shift
  mkdir -p "runs/$name"
  setsid nohup nice -n 5 $PY -m "jobs.train.$name" "$@" --resume --threads 1 >> "runs/$name/train.log" 2>&1 < /dev/null &
  echo "started jobs.train.$name (log runs/$name/train.log)"
}
if [ "$(step_of tokenizer)" -lt $TOK_STEPS ]; then
  start tokenizer --data data/emoji --out runs/tokenizer --steps $TOK_STEPS --freeze-codes-at 1
fi
if [ "$(step_of target)" -lt $TARGET_STEPS ]; then
  start target --data data/emoji --tokenizer runs/tokenizer/codes --out runs/target --steps $TARGET_STEPS
elif [ "$(step_of drafter)" -lt $DRAFTER_STEPS ]; then
  start drafter --data data/emoji --target runs/target --out runs/drafter --steps $DRAFTER_STEPS
else
  echo "target and drafter finished: python -m jobs.train.export --tokenizer runs/tokenizer/final" \
       "--target runs/target --drafter runs/drafter --data data/emoji --out adt_core/bundles/emoji16"
fi
