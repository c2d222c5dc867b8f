"""FLAN-T5 caption handling: LlamaGen's cleaning, 120-token padding / truncation, valid rows
moved to the end, padding zeroed. A tiny random T5 is built from a transformers T5Config and a
tiny Unigram tokenizer is written locally (no download; no sentencepiece model needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from adt_core.bundles.bundle import build_text_encoder
from adt_core.families.llamagen.t5 import T5TextEncoder, clean_caption, preprocess_caption, right_align

WORDS = "a an the of on in with and photo cat dog red blue green apple table sitting tree grass sun over hills".split()


def write_tiny_t5(d: Path, d_model: int = 16, seed: int = 0) -> Path:
    """A random 1-layer T5 encoder-decoder checkpoint plus a word-level Unigram tokenizer."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + w, -1.0 - i / 100) for i, w in enumerate(WORDS)]
    vocab += [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz!,."]
    T5Tokenizer(vocab=vocab, extra_ids=0).save_pretrained(str(d))
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0)
    T5EncoderModel(cfg).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return write_tiny_t5(tmp_path_factory.mktemp("flan-t5-tiny"))


@pytest.mark.parametrize("raw,clean", [
    ("A Photo of a CAT", "a photo of a cat"),
    ("A red <b>apple</b> on a table, see https://example.com/x.jpg now", "a red apple on a table, see now"),
    ("Check www.shop.com/cat for @seller deals &amp; more", "check for deals more"),
    ("this-is-my-cute-cat", "this is my cute cat"),
    ('"A quoted caption"', "a quoted caption"),
    ("img_1234.png of a tree", "of a tree"),
    ("a cat 1920x1080 wallpaper", "a cat wallpaper"),
    ("Tom & Jerry", "tom jerry"),
    ("Caf\u00e9 \u2014 Paris", "caf\u00e9 - paris"),
    ("\u4e1c\u4eac tower", "tower"),
    ("a dog   sitting\\non grass", "a dog sitting on grass"),
])
def test_llamagen_caption_cleaning(raw, clean):
    assert preprocess_caption(raw) == clean
    assert preprocess_caption(raw, clean=False) == raw.lower().strip()


# Inputs where an HTML stripper or a text fixer could go its own way; the fallback (no bs4, no
# ftfy) must agree with LlamaGen's packages on all of them but mojibake, which only ftfy repairs.
EDGE_CAPTIONS = [
    "a <script>alert(1)</script> red cat", "<style>p{color:red}</style>a red cat", "a <![CDATA[raw]]> cat",
    "<b>bold</b> &amp; <i>italic</i> dog", "a < b > c", "<!-- hidden --> a dog", "unclosed <div class='x'>tree",
    "line<br/>break", "zero\u200bwidth space", "\uff21 full-width \uff43at", "\ufb01ne ligature",
    "\u201ccurly\u201d \u2018quotes\u2019", "tab\tand\x07bell", "crlf\r\nline", "&lt;tag&gt; text",
]
MOJIBAKE = "don\u00e2\u20ac\u2122t stop"


@pytest.fixture
def without_cleaner_packages(monkeypatch):
    """bs4 and ftfy made unimportable (sys.modules entry None), as on a machine without them."""
    from adt_core.families.llamagen import t5

    monkeypatch.setitem(sys.modules, "bs4", None)
    monkeypatch.setitem(sys.modules, "ftfy", None)
    t5._optional.cache_clear()
    yield
    t5._optional.cache_clear()


def test_the_fallback_cleaner_matches_bs4_and_ftfy_but_warns_once(caplog, request):
    pytest.importorskip("bs4")
    pytest.importorskip("ftfy")
    with caplog.at_level("WARNING", logger="adt_core.families.llamagen.t5"):
        real = [preprocess_caption(c) for c in EDGE_CAPTIONS + [MOJIBAKE]]
        assert not caplog.records
        request.getfixturevalue("without_cleaner_packages")
        fallback = [preprocess_caption(c) for c in EDGE_CAPTIONS + [MOJIBAKE]]
    assert fallback[:-1] == real[:-1] and fallback[-1] != real[-1]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # once per package, not once per caption
    for package in ("beautifulsoup4", "ftfy"):
        (msg,) = [m for m in warned if m.startswith(package)]
        assert "pip install 'adt-tree[t5]'" in msg and f"pip install {package}" in msg


def test_the_encoder_names_a_missing_cleaner_package_when_it_loads(t5_dir, without_cleaner_packages, caplog):
    with caplog.at_level("WARNING", logger="adt_core.families.llamagen.t5"):
        T5TextEncoder(t5_dir, max_tokens=8, dtype="float32", device="cpu", clean=False).encode(["a cat"])
        assert not caplog.records  # no cleaning asked for, nothing degraded
        T5TextEncoder(t5_dir, max_tokens=8, dtype="float32", device="cpu")
    assert sorted(r.getMessage().split(" ")[0] for r in caplog.records) == ["beautifulsoup4", "ftfy"]


def test_cleaning_is_applied_twice():
    once = clean_caption("'''quoted'''")
    assert preprocess_caption("'''quoted'''") == clean_caption(once)


def test_right_align_rotates_valid_rows_to_the_end():
    states = torch.arange(1, 1 + 2 * 5 * 2, dtype=torch.float32).view(2, 5, 2)
    valid = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    emb, mask = right_align(states, valid)
    assert mask.tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    assert torch.equal(emb[0, 3:], states[0, :2]) and torch.all(emb[0, :3] == 0)
    assert torch.equal(emb[1], states[1])


def test_tiny_t5_encodes_with_llamagen_placement(t5_dir):
    enc = T5TextEncoder(t5_dir, max_tokens=12, dtype="float32", device="cpu")
    prompts = ["A red cat", "the dog sitting on a blue table with a cat under the sun over green hills", ""]
    emb, mask = enc.encode(prompts)
    assert emb.shape == (3, 12, 16) and emb.dtype == torch.float32
    assert mask.shape == (3, 12) and mask.dtype == torch.bool
    ids, valid = enc.tokenize(prompts)
    n = valid.sum(1)
    assert n.tolist() == [4, 12, 1]  # 3 words + EOS; truncated to 12 (EOS kept); EOS alone
    assert ids[1, -1].item() == enc.tokenizer.eos_token_id
    for i, k in enumerate(n.tolist()):
        assert mask[i].tolist() == [False] * (12 - k) + [True] * k
        assert torch.all(emb[i, : 12 - k] == 0)
        # the valid rows, in order, are the encoder's states of the unpadded prompt
        with torch.no_grad():
            ref = enc.model(input_ids=ids[i : i + 1, :k]).last_hidden_state[0]
        assert torch.allclose(emb[i, 12 - k :], ref, atol=1e-5)


def test_padding_does_not_change_a_prompt(t5_dir):
    enc = T5TextEncoder(t5_dir, max_tokens=12, dtype="float32", device="cpu")
    alone, _ = enc.encode(["blue apple"])
    batch, _ = enc.encode(["blue apple", "a green tree on grass with a dog and a cat"])
    assert torch.allclose(alone[0], batch[0], atol=1e-5)


def test_bf16_default_and_spec(t5_dir):
    enc = build_text_encoder({"type": "t5", "path": str(t5_dir), "max_tokens": 8, "device": "cpu"})
    assert isinstance(enc, T5TextEncoder)
    assert next(enc.model.parameters()).dtype == torch.bfloat16
    emb, mask = enc.encode(["a cat"])
    assert emb.dtype == torch.float32 and emb.shape == (1, 8, 16) and mask.sum() == 3
    assert enc.config() == {"type": "t5", "path": str(t5_dir), "max_tokens": 8, "dtype": "bfloat16",
                            "device": "cpu", "clean": True}
    with pytest.raises(ValueError, match="fp16"):
        T5TextEncoder(t5_dir, dtype="float16")
    with pytest.raises(FileNotFoundError, match="config.json"):
        T5TextEncoder(t5_dir / "nowhere")
