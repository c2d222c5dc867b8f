"""Training prompts for the emoji16 drafter recipe, built offline from the Unicode names.

    python -m jobs.train.emoji_prompts --out outputs/emoji_prompts.parquet

A self-distilled drafter needs prompts, not images: the target draws its own images for them
(jobs.train_drafter). The emoji16 target was trained on captions made from emoji names
(jobs/train/data.py: "grinning face", "an emoji of a grinning face", ...), so these prompts
are the Unicode character names of the emoji blocks (Python's `unicodedata`, no download) and
"<country> flag" for the ISO 3166 names in the system's tzdata (`iso3166.tab`, skipped where
absent), each as the bare name and as "an emoji of a <name>", with one seed per row.

Names that occur in the evaluation prompts (`--exclude`, default examples/prompts.parquet: the
64 prompts the shipped drafter is measured on) are left out, so those prompts stay held out.
Columns: prompt_id (string, unique), prompt (string), seed (int64); the order is deterministic.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Unicode blocks that hold pictographic emoji (misc symbols, pictographs, emoticons, transport,
# supplemental and extended-A symbols); dingbat arrows and geometric shapes are left out.
EMOJI_BLOCKS = ((0x2600, 0x26FF), (0x1F300, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF), (0x1FA70, 0x1FAFF))
ISO3166 = Path("/usr/share/zoneinfo/iso3166.tab")
SEED_BASE = 100_000  # far from the example prompts' seeds (1000 + i)


def emoji_names() -> list[str]:
    """Lower-case Unicode names of the characters in EMOJI_BLOCKS, in code point order."""
    names = []
    for lo, hi in EMOJI_BLOCKS:
        for cp in range(lo, hi + 1):
            name = unicodedata.name(chr(cp), "")
            if name and not name.startswith(("EMOJI COMPONENT", "REGIONAL INDICATOR")):
                names.append(name.lower())
    return names


def flag_names(path: Path = ISO3166) -> list[str]:
    """'<country> flag' for every row of tzdata's iso3166.tab (empty when the file is absent)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name = line.split("\t", 1)[1].strip().lower()
            out.append(re.sub(r"\s*\(.*?\)", "", name).replace("&", "and") + " flag")
    return out


def with_article(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def core_name(prompt: str) -> str:
    """'an emoji of a grinning face' -> 'grinning face'."""
    return re.sub(r"^an emoji of (an? )?", "", prompt.strip().lower())


def build_rows(exclude: set[str]) -> list[dict]:
    rows, seen = [], set()
    for name in emoji_names() + flag_names():
        if name in exclude or name in seen:
            continue
        seen.add(name)
        for caption in (name, f"an emoji of {with_article(name)}"):
            i = len(rows)
            digest = hashlib.sha256(caption.encode()).hexdigest()[:8]
            rows.append({"prompt_id": f"e{i:05d}-{digest}", "prompt": caption, "seed": SEED_BASE + i})
    return rows


def write(rows: list[dict], out: Path) -> None:
    table = pa.table({"prompt_id": pa.array([r["prompt_id"] for r in rows], pa.string()),
                      "prompt": pa.array([r["prompt"] for r in rows], pa.string()),
                      "seed": pa.array([r["seed"] for r in rows], pa.int64())})
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.train.emoji_prompts", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/emoji_prompts.parquet"))
    p.add_argument("--exclude", type=Path, default=Path("examples/prompts.parquet"),
                   help="a prompt Parquet whose names are left out (the evaluation prompts)")
    args = p.parse_args(argv)
    exclude = {core_name(s) for s in pq.read_table(args.exclude, columns=["prompt"])["prompt"].to_pylist()} \
        if args.exclude and args.exclude.is_file() else set()
    rows = build_rows(exclude)
    write(rows, args.out)
    print(f"{len(rows)} prompts ({len(rows) // 2} names, {len(exclude)} evaluation names left out) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
