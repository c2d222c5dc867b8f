"""Build the emoji training set: 64x64 RGB images + captions, with a held-out split.

    python -m jobs.train.data --out data/emoji [--tarball PATH] [--prompts examples/prompts.parquet]

Source: the npm package emoji-datasource-google@16.0.0 (emoji.json metadata, MIT) whose
img/google/64/*.png are Google's Noto Color Emoji (Apache-2.0). The package is fetched with
`npm pack` (or a tarball given / cached in OUT/.cache) and read straight from the tarball.

Split: an emoji and all its skin-tone variants (and an emoji and the one that obsoletes it,
which share artwork) form one group; a group is held out when sha256 of its unified code
falls in the lowest 5% of the hash range. Held-out images and their captions are never
trained on.

Outputs in OUT: {train,heldout}_images.npy (uint8 N,64,64,3), {train,heldout}_captions.json
(list of caption lists aligned with the images), {train,heldout}_ids.json (unified codes),
meta.json, README.md, LICENSE-data.txt (the package's MIT licence text). Also writes the
example prompt table (prompt_id, prompt, seed) used by the generation job.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

PACKAGE = "emoji-datasource-google"
VERSION = "16.0.0"
IMAGE_DIR = "package/img/google/64/"
SIZE = 64
HELDOUT_PER_10K = 500  # 5% of groups
TONES = {"1F3FB": "light", "1F3FC": "medium-light", "1F3FD": "medium",
         "1F3FE": "medium-dark", "1F3FF": "dark"}

# Recognisable emoji for the example prompts (short names), tried in this order.
PROMPT_SHORT_NAMES = [
    "grinning", "joy", "heart_eyes", "sunglasses", "thinking_face", "sob", "rage", "scream",
    "star-struck", "partying_face", "ghost", "skull", "robot_face", "hankey", "cat", "dog",
    "unicorn_face", "panda_face", "frog", "penguin", "fox_face", "octopus", "butterfly",
    "sunflower", "pizza", "hamburger", "apple", "banana", "watermelon", "strawberry",
    "birthday", "coffee", "heart", "yellow_heart", "blue_heart", "broken_heart", "fire",
    "star", "rainbow", "snowman", "rocket", "car", "soccer", "guitar", "crown", "flag-fr",
    "flag-jp", "rainbow-flag",
    # fallbacks, used only if some of the above land in the held-out split
    "flag-br", "flag-ca", "gift", "balloon", "gem", "basketball", "airplane", "house",
    "zap", "cactus", "turtle", "tiger", "doughnut", "avocado", "green_heart", "+1", "wave",
]
N_TRAIN_PROMPTS = 48
N_HELDOUT_PROMPTS = 16
PROMPT_SEED_BASE = 1000


@dataclass
class Item:
    """One image: its unified code, split group, tarball path and captions."""

    unified: str
    group: str
    image: str
    captions: list[str]
    short_names: list[str] = field(default_factory=list)
    category: str = ""
    is_variant: bool = False


# ---------------------------------------------------------------- package fetching


def fetch_tarball(out: Path, tarball: Path | None) -> Path:
    """Return a local tarball of the package: the given one, a cached one, or `npm pack`."""
    if tarball is not None:
        return tarball
    cache = out / ".cache"
    cached = cache / f"{PACKAGE}-{VERSION}.tgz"
    if cached.exists():
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", tmp],
                       check=True, stdout=subprocess.DEVNULL)
        (Path(tmp) / cached.name).rename(cached)
    return cached


def read_members(tar_path: Path) -> dict[str, bytes]:
    """All regular files of the tarball except the sprite sheets, by path."""
    files = {}
    with tarfile.open(tar_path, "r:gz") as tar:
        for m in tar:
            if m.isfile() and "/sheets" not in m.name:
                files[m.name] = tar.extractfile(m).read()
    return files


# ---------------------------------------------------------------- captions


def _with_article(noun: str) -> str:
    """'grinning face' -> 'a grinning face'; plurals ('socks') get no article."""
    head = re.split(r" with | of |, ", noun)[0].split()
    last = head[-1] if head else noun
    if last.endswith("s") and not last.endswith(("ss", "us", "is")):
        return noun
    vowel = noun[:1] in "aeiou" and not noun.startswith(("uni", "use", "eu", "one"))
    return f"{'an' if vowel else 'a'} {noun}"


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("_", " ")).strip().lower()


def _useful_short_names(short_names: list[str], name: str) -> list[str]:
    """Short names as words; drop codes like 'flag-fr', '+1', 'clock9'-style duplicates."""
    out = []
    for s in short_names:
        if re.fullmatch(r"flag-[a-z]{2}", s) or not re.search(r"[a-z]{3}", s):
            continue
        words = _clean(s.replace("-", " "))
        if words != name:
            out.append(words)
    return out


def tone_suffix(tone_key: str) -> str:
    """'1F3FB' -> 'light skin tone'; '1F3FB-1F3FF' -> 'light and dark skin tones'."""
    tones = [TONES[t] for t in tone_key.split("-")]
    if len(set(tones)) == 1:
        return f"{tones[0]} skin tone"
    return f"{' and '.join(tones)} skin tones"


def build_captions(name: str, short_names: list[str], category: str, subcategory: str,
                   tone: str | None = None) -> list[str]:
    """Several lower-case captions for one image, most specific first, no duplicates."""
    name = _clean(name)
    shorts = _useful_short_names(short_names, name)
    cat = _clean(category)
    sub = _clean(subcategory.replace("-", " "))
    if tone:
        suffix = tone_suffix(tone)
        name = f"{name}, {suffix}"
        shorts = [f"{s}, {suffix}" for s in shorts]
    caps = [name, f"an emoji of {_with_article(name)}", f"{cat}: {name}",
            f"{sub} emoji: {name}"]
    caps += shorts + [f"an emoji of {_with_article(s)}" for s in shorts[:1]]
    return list(dict.fromkeys(caps))


# ---------------------------------------------------------------- items and split


def _items_for(entry: dict) -> list[Item]:
    group = (entry.get("obsoleted_by") or entry["unified"]).upper()
    common = dict(short_names=entry["short_names"], category=entry["category"])
    items = []
    if entry.get("has_img_google"):
        caps = build_captions(entry["name"], entry["short_names"], entry["category"],
                              entry["subcategory"])
        items.append(Item(entry["unified"], group, entry["image"], caps, **common))
    for tone, var in sorted(entry.get("skin_variations", {}).items()):
        if var.get("has_img_google"):
            caps = build_captions(entry["name"], entry["short_names"], entry["category"],
                                  entry["subcategory"], tone)
            items.append(Item(var["unified"], group, var["image"], caps, is_variant=True,
                              **common))
    return items


def collect_items(emoji: list[dict], files: dict[str, bytes]) -> tuple[list[Item], int]:
    """Items whose PNG exists in the package, in sort order; also the number skipped."""
    items, missing = [], 0
    for entry in sorted(emoji, key=lambda e: e["sort_order"]):
        for it in _items_for(entry):
            if IMAGE_DIR + it.image in files:
                items.append(it)
            else:
                missing += 1
    return items, missing


def is_heldout(group: str) -> bool:
    h = int.from_bytes(hashlib.sha256(group.encode()).digest()[:8], "big")
    return h % 10_000 < HELDOUT_PER_10K


def load_rgb64(png: bytes) -> np.ndarray:
    """PNG bytes (any mode) -> uint8 (64, 64, 3), alpha composited over white."""
    img = Image.open(io.BytesIO(png)).convert("RGBA")
    if img.size != (SIZE, SIZE):
        img = img.resize((SIZE, SIZE), Image.Resampling.LANCZOS)
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, img).convert("RGB"), dtype=np.uint8)


# ---------------------------------------------------------------- prompts


def choose_prompts(train: list[Item], heldout: list[Item]) -> list[dict]:
    """~48 captions of recognisable training emoji + ~16 held-out ones, with seeds."""
    by_short = {}
    for it in train:
        if not it.is_variant:
            for s in it.short_names:
                by_short.setdefault(s, it)
    picked = [by_short[s] for s in PROMPT_SHORT_NAMES if s in by_short][:N_TRAIN_PROMPTS]
    held = _spread([it for it in heldout if not it.is_variant], N_HELDOUT_PROMPTS)
    rows = []
    for i, it in enumerate(picked + held):
        prompt = it.captions[1] if i % 2 == 0 else it.captions[0]  # "an emoji of ..." / name
        rows.append({"prompt_id": f"p{i:03d}", "prompt": prompt,
                     "seed": PROMPT_SEED_BASE + i, "split": "train" if i < len(picked)
                     else "heldout"})
    return rows


def _spread(items: list[Item], n: int) -> list[Item]:
    """n items spread over the categories (round-robin), deterministic."""
    by_cat: dict[str, list[Item]] = {}
    for it in items:
        by_cat.setdefault(it.category, []).append(it)
    out: list[Item] = []
    queues = [list(v) for _, v in sorted(by_cat.items())]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def write_prompts(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "prompt_id": pa.array([r["prompt_id"] for r in rows], pa.string()),
        "prompt": pa.array([r["prompt"] for r in rows], pa.string()),
        "seed": pa.array([r["seed"] for r in rows], pa.int64()),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


# ---------------------------------------------------------------- outputs


def licence_facts(files: dict[str, bytes]) -> dict:
    readme = files.get("package/README.md", b"").decode("utf-8", "replace")
    noto_line = next((ln.strip() for ln in readme.splitlines()
                      if "Google/Noto images" in ln), "")
    pkg = json.loads(files["package/package.json"])
    return {
        "data_package": f"{pkg['name']}@{pkg['version']}",
        "data_package_license": pkg["license"],
        "data_package_copyright": "Copyright (c) 2013 Cal Henderson (iamcal/emoji-data)",
        "images": "Noto Color Emoji (googlefonts/noto-emoji), as shipped in img/google/64",
        "images_license": "Apache-2.0",
        "images_license_statement": noto_line,
        "flags_note": ("per googlefonts/noto-emoji, country-flag images come from its "
                       "third_party/region-flags and are public domain or otherwise exempt "
                       "from copyright"),
        "homepage": pkg.get("homepage", ""),
    }


def write_split(out: Path, name: str, items: list[Item], files: dict[str, bytes]) -> None:
    images = np.stack([load_rgb64(files[IMAGE_DIR + it.image]) for it in items])  # (N,64,64,3)
    np.save(out / f"{name}_images.npy", images)
    (out / f"{name}_captions.json").write_text(json.dumps([it.captions for it in items]))
    (out / f"{name}_ids.json").write_text(json.dumps([it.unified for it in items]))


def write_readme(out: Path, meta: dict) -> None:
    lic = meta["license"]
    text = f"""# Emoji training set (64x64 RGB, captions)

Built by `python -m jobs.train.data` from the npm package {lic['data_package']}.

- Metadata (emoji.json, names, categories): {lic['data_package_license']} licence,
  {lic['data_package_copyright']}; full text in LICENSE-data.txt.
- Images: {lic['images']}; licensed {lic['images_license']}.
  Package README: "{lic['images_license_statement']}"
  Attribution: emoji artwork by Google, Noto Emoji project (https://github.com/googlefonts/noto-emoji).
  Flags: {lic['flags_note']}.
- Processing: each PNG composited onto white and stored as uint8 RGB 64x64.

Counts: {meta['counts']}

Held-out split: groups (emoji + skin-tone variants + obsoleted aliases) whose sha256 of
the unified code lands in the lowest {HELDOUT_PER_10K / 100:.0f}% are held out; their images and
captions are never used for training.
"""
    (out / "README.md").write_text(text)


def build(out: Path, tarball: Path | None, prompts_path: Path | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    files = read_members(fetch_tarball(out, tarball))
    emoji = json.loads(files["package/emoji.json"])
    items, missing = collect_items(emoji, files)
    train = [it for it in items if not is_heldout(it.group)]
    heldout = [it for it in items if is_heldout(it.group)]
    for name, split in (("train", train), ("heldout", heldout)):
        write_split(out, name, split, files)
    counts = {
        "train_images": len(train), "heldout_images": len(heldout),
        "train_captions": sum(len(it.captions) for it in train),
        "heldout_captions": sum(len(it.captions) for it in heldout),
        "train_groups": len({it.group for it in train}),
        "heldout_groups": len({it.group for it in heldout}),
        "skipped_missing_images": missing,
    }
    meta = {"source": f"npm:{PACKAGE}@{VERSION}", "version": VERSION, "image_size": SIZE,
            "background": "white", "counts": counts, "license": licence_facts(files),
            "split": f"sha256(group unified code) % 10000 < {HELDOUT_PER_10K}"}
    if prompts_path is not None:
        rows = choose_prompts(train, heldout)
        write_prompts(rows, prompts_path)
        meta["prompts"] = {split: [r["prompt_id"] for r in rows if r["split"] == split]
                           for split in ("train", "heldout")}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    (out / "LICENSE-data.txt").write_bytes(files["package/LICENSE"])
    write_readme(out, meta)
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("data/emoji"))
    p.add_argument("--tarball", type=Path, default=None, help="use this package tarball")
    p.add_argument("--prompts", type=Path, default=Path("examples/prompts.parquet"),
                   help="where to write the example prompt table")
    p.add_argument("--no-prompts", action="store_true")
    args = p.parse_args(argv)
    meta = build(args.out, args.tarball, None if args.no_prompts else args.prompts)
    print(json.dumps(meta["counts"]))


if __name__ == "__main__":
    main()
