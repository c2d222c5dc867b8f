"""The Janus-Pro-7B manifest (hf:// sources, licence, Janus' sampling defaults), and the family's
parts working together on one tiny checkpoint directory in the published layout: prompter ->
target prefill with ragged CFG rows -> greedy CFG decoding -> VQ decoder -> images."""

from pathlib import Path

import pytest
import torch
import yaml

from adt_core.bundles.hub import is_directory
from adt_core.bundles.sources import split_hf
from adt_core.config import SamplingConfig
from adt_core.families.registry import get_family
from adt_core.families.janus.prompt import JANUS_SAMPLING
from janus_fixtures import GRID, TEXT_VOCAB, make_hf_janus, make_tokenizer, save_published

MANIFEST = Path(__file__).resolve().parents[2] / "infra" / "manifests" / "janus_pro_7b.yaml"


def test_manifest_names_the_hub_checkpoint_licence_and_defaults():
    m = yaml.safe_load(MANIFEST.read_text())
    assert m["family"] == "janus" and m["grid"] == 24
    get_family(m["family"])
    for part in ("target", "vq", "tokenizer"):
        assert split_hf(m[part]["path"]) == ("deepseek-ai/Janus-Pro-7B", "main", "")
        assert is_directory(split_hf(m[part]["path"])[2])
    assert "drafter" not in m  # none published; jobs.train_drafter makes one
    assert m["license"]["model"].startswith("DeepSeek License Agreement") and m["license"]["code"] == "MIT"
    assert SamplingConfig(**m["sampling"]) == SamplingConfig(**JANUS_SAMPLING)
    assert m["dtype"] == "bfloat16"
    from adt_core.bundles.loader import read_any_manifest

    parsed = read_any_manifest(MANIFEST)  # the family manifest schema, nothing fetched
    assert parsed.family == "janus" and parsed.prompt["grid"] == 24 and "drafter" not in parsed.parts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers.models.janus", reason="transformers >= 4.52 has models/janus")
    d = save_published(make_hf_janus(seed=2), tmp_path_factory.mktemp("janus_pro_tiny"))
    make_tokenizer(d / "tokenizer.json")
    return d


@torch.no_grad()
def test_family_parts_generate_an_image_from_one_directory(checkpoint):
    fam = get_family("janus")
    target = fam.load_target(checkpoint, dtype=torch.float32, device="cpu")
    decoder = fam.load_decoder(checkpoint, device="cpu")
    prompter = fam.load_prompter(checkpoint, grid=GRID)
    assert prompter.vocab == target.vocab and target.vocab.first_id == TEXT_VOCAB

    prompts = ["a cat", "an oil painting of a harbour at night"]  # ragged rows
    rows = prompter.rows(prompts, cfg=True)
    b, n = rows.images, rows.tokens.shape[1]
    cache = target.new_cache(rows.rows, n + prompter.layout.length)
    logits, _ = target(rows.positions, rows.causal_mask(), cache, tokens=rows.tokens)
    cache.set_lengths(rows.lengths)
    last = logits[torch.arange(rows.rows), rows.lengths - 1]  # each row's begin-of-image position
    codes = []
    for i in range(prompter.layout.num_codes):
        mixed = last[b:] + JANUS_SAMPLING["cfg_scale"] * (last[:b] - last[b:])
        code = mixed.argmax(-1)
        codes.append(code)
        positions = (rows.lengths + prompter.layout.offset(i))[:, None]
        ids = target.vocab.to_id(code).repeat(2)[:, None]
        logits, _ = target(positions, cache.attn_mask(torch.ones(1, 1, dtype=torch.bool)), cache, tokens=ids)
        last = logits[:, -1]
    grid = torch.stack(codes, 1).view(b, GRID, GRID)

    # the same first prompt alone (no batch padding) gives the same image
    alone = prompter.rows(prompts[:1], cfg=True)
    c1 = target.new_cache(2, alone.tokens.shape[1] + 1)
    lg, _ = target(alone.positions, alone.causal_mask(), c1, tokens=alone.tokens)
    first = (lg[1, -1] + 5.0 * (lg[0, -1] - lg[1, -1])).argmax()
    assert int(first) == int(grid[0, 0, 0])

    images = decoder.decode(grid)
    assert images.shape == (b, GRID * decoder.downsample_factor, GRID * decoder.downsample_factor, 3)
    assert images.dtype == torch.uint8
