"""Chameleon tokenizer and the Lumina-mGPT / Anole layouts, on a tiny tokenizer.json with
Chameleon's id layout (built offline with `tokenizers`)."""

import pytest
import torch

from adt_core.families.chameleon.prompt import (
    LuminaPrompter, check_lumina_size, image_code_of, load_prompter, load_tokenizer, lumina_sizes,
)
from adt_core.families.contract import ImageVocab, Layout, Prompter
from adt_core.families.registry import get_family
from chameleon_fixtures import image_token_name, make_tokenizer


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_special_ids_and_image_vocab_come_from_the_tokenizer(tok_path):
    tok = load_tokenizer(tok_path.parent)
    assert tok.ids == {"bos": 0, "pad": 1, "image_start": 8197, "image_end": 8196, "end_of_turn": 8710,
                       "end_of_line": 8803}
    assert tok.size_token(24) == 8828 and tok.size_token(48) == 8852
    assert (tok.vocab.first_id, tok.vocab.num_codes) == (4, 8192)
    assert image_code_of(image_token_name(8191)) == 8191 and image_code_of("IMGIMGxZ") is None
    assert tok.decode(tok.encode("an apple, 3 cats")) == "an apple, 3 cats"
    assert tok.encode("x<reserved08706>") == tok.encode("x") + [8710]  # added tokens split as one id


def test_meta_text_tokenizer_path(tok_path, tmp_path):
    make_tokenizer(tmp_path / "tokenizer" / "text_tokenizer.json")
    assert load_tokenizer(tmp_path).source.endswith("tokenizer/text_tokenizer.json")
    with pytest.raises(FileNotFoundError, match="none of tokenizer.json"):
        load_tokenizer((tmp_path / "empty").mkdir() or tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")


def test_lumina_768_rows_and_layout(tok_path):
    p = load_prompter(tok_path, "lumina")
    assert isinstance(p, Prompter)
    lay = p.layout
    assert (lay.grid_h, lay.grid_w, lay.stride, lay.length) == (48, 48, 49, 48 * 49 + 1)
    assert lay.head == (8197, 8828, 8828) and (lay.eol, lay.end) == (8803, 8196)
    text = p.tokenizer.encode("Generate an image of 768x768 according to the following prompt:\na cat")
    assert p.cond_ids("a cat") == [0, *text, 8710, 8197, 8828, 8828]

    rows = p.rows(["a cat", "a red bicycle on a hill"], cfg=True)
    assert rows.images == 2 and rows.rows == 4 and rows.cfg
    n0, n1 = len(p.cond_ids("a cat")), len(p.cond_ids("a red bicycle on a hill"))
    assert rows.lengths.tolist() == [n0, n1, 3, 3]  # uncond: image start + sizes, its own positions
    assert rows.tokens[2, :3].tolist() == [8197, 8828, 8828] and rows.positions[2, :3].tolist() == [0, 1, 2]
    assert rows.valid.sum(1).tolist() == rows.lengths.tolist()
    assert (rows.tokens[~rows.valid] == 1).all()  # right padding with <pad>
    assert rows.tokens[0, n0 - 3 : n0].tolist() == list(lay.head)
    assert p.rows(["a cat"], cfg=False).rows == 1


def test_lumina_non_square_size_tokens_and_rows(tok_path):
    tok = load_tokenizer(tok_path)
    p = LuminaPrompter(tok, width=1024, height=576)
    assert p.layout.head == (8197, 8804 + 18, 8804 + 32)  # height patches first, then width
    assert (p.layout.grid_h, p.layout.grid_w, p.layout.stride) == (36, 64, 65)
    assert "1024x576" in p.text("x")
    wide = LuminaPrompter(tok, width=512, height=512, trained_px=512)
    assert wide.layout.head == (8197, 8820, 8820)


def test_lumina_sizes():
    sizes = lumina_sizes(768)
    assert (768, 768) in sizes and (1024, 576) in sizes and (576, 1024) in sizes and (1536, 384) in sizes
    assert all(max(w, h) / min(w, h) <= 4 and (w // 32) * (h // 32) <= 576 for w, h in sizes)
    assert (512, 512) not in sizes  # far under the patch budget: not a training crop of the 768 model
    with pytest.raises(ValueError, match="multiples of 32"):
        check_lumina_size(770, 768, 768)
    with pytest.raises(ValueError, match="closest: "):
        check_lumina_size(2048, 256, 768)


def test_anole_rows_and_layout(tok_path, tmp_path):
    p = load_prompter(tok_path, "anole")
    lay = p.layout
    assert (lay.grid_h, lay.grid_w, lay.length, lay.head, lay.eol, lay.end) == (32, 32, 1025, (8197,), None, 8196)
    assert p.cond_ids("an apple") == [0, *p.tokenizer.encode("an apple"), 8710, 8197]
    rows = p.rows(["an apple"], cfg=True)
    assert rows.tokens[1, :2].tolist() == [0, 8197] and rows.lengths[1] == 2
    with pytest.raises(ValueError, match="512x512 images only"):
        load_prompter(tok_path, "anole", width=768, height=768)
    with pytest.raises(ValueError, match="unknown Chameleon layout"):
        load_prompter(tok_path, "janus")


def test_lumina_layout_positions_and_forced_tokens():
    lay = Layout(3, 4, head=(8197, 8806, 8806), eol=8803, end=8196)
    idx = torch.arange(12)
    assert lay.offset(idx).tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]
    assert lay.rowcol(5) == (1, 1)
    forced = lay.forced()
    assert forced.offsets.tolist() == [4, 9, 14, 15] and forced.ids.tolist() == [8803] * 3 + [8196]
    assert lay.forced_after(3) == (8803,) and lay.forced_after(11) == (8803, 8196) and lay.forced_after(4) == ()
    codes = torch.arange(100, 112)
    seq = lay.assemble(codes)
    assert seq.tolist() == [8197, 8806, 8806, 100, 101, 102, 103, 8803, 104, 105, 106, 107, 8803,
                            108, 109, 110, 111, 8803, 8196]
    assert lay.split(seq).tolist() == codes.view(3, 4).tolist()
    bad = seq.clone()
    bad[3 + 9] = 5
    with pytest.raises(ValueError, match="offset 9"):
        lay.split(bad)


def test_anole_layout_and_vocab():
    lay = Layout(32, 32, head=(8197,), end=8196)
    assert lay.offset(1023) == 1023 and lay.forced().offsets.tolist() == [1024]
    assert lay.forced_after(1022) == () and lay.forced_after(1023) == (8196,)
    v = ImageVocab(4, 8192, 65536)
    ids = torch.tensor([3, 4, 8195, 8196])
    assert v.is_code(ids).tolist() == [False, True, True, False]
    assert v.to_code(v.to_id(torch.tensor([0, 8191]))).tolist() == [0, 8191]
    with pytest.raises(ValueError):
        ImageVocab(4, 8192, 8000)


def test_prompt_causal_mask(tok_path):
    rows = load_prompter(tok_path, "anole").rows(["an apple"], cfg=True)
    m = rows.causal_mask()
    n = rows.tokens.shape[1]
    assert m.shape == (2, 1, n, n)
    assert m[1, 0, 1, :2].tolist() == [True, True] and not m[1, 0, 1, 2:].any()
    assert m[1, 0].diagonal().all()


def test_registry_knows_chameleon():
    fam = get_family("chameleon")
    assert fam.name == "chameleon" and fam.load_prompter is load_prompter
    with pytest.raises(KeyError, match="known: chameleon"):
        get_family("nope")
