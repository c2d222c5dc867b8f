"""Janus-Pro prompts: DeepSeek's chat template + begin-of-image, special ids by name, Janus' CFG
row (same length, BOS and begin-of-image kept, pads between, every entry attended), the 24 x 24
layout, and the sampling defaults."""

import json

import pytest
import torch

from adt_core.config import SamplingConfig
from adt_core.families.contract import ImageVocab, Prompter
from adt_core.families.janus.prompt import (
    GRID,
    JANUS_SAMPLING,
    JanusPrompter,
    load_prompter,
    load_tokenizer,
)
from janus_fixtures import BOI, BOS, CODES, PAD, TEXT_VOCAB, hf_config, make_tokenizer, published_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """tokenizer.json + special_tokens_map.json + a published config.json (text vocabulary 288)."""
    d = tmp_path_factory.mktemp("janus_tok")
    make_tokenizer(d / "tokenizer.json")
    (d / "config.json").write_text(json.dumps(published_config(hf_config())))
    return d


def test_cond_row_is_the_chat_template_then_begin_of_image(ckpt):
    p = load_prompter(ckpt)
    assert isinstance(p, Prompter)
    tok = p.tokenizer
    assert (tok.ids["bos"], tok.ids["pad"], tok.ids["image_start"]) == (BOS, PAD, BOI)
    ids = p.cond_ids("  a cat on a mat ")
    text = "<|User|>: a cat on a mat\n\n<|Assistant|>:"
    assert p.text(" a cat on a mat ") == text
    assert ids == [BOS, *tok.encode(text), BOI]
    # as Janus builds it: the whole string, begin-of-image included, through the tokenizer
    assert ids[1:] == tok.tok.encode(text + "<begin_of_image>", add_special_tokens=False).ids
    assert tok.decode(ids[1:-1]) == text


def test_cfg_rows_same_length_pads_attended(ckpt):
    p = load_prompter(ckpt)
    prompts = ["a red bird", "an old lighthouse on a cliff at dusk"]
    rows = p.rows(prompts, cfg=True)
    assert rows.rows == 4 and rows.images == 2 and rows.cfg and rows.tokens is not None and rows.embeds is None
    cond = [p.cond_ids(q) for q in prompts]
    for b, c in enumerate(cond):
        n = len(c)
        assert int(rows.lengths[b]) == int(rows.lengths[2 + b]) == n
        assert rows.tokens[b, :n].tolist() == c
        assert rows.tokens[2 + b, :n].tolist() == [BOS] + [PAD] * (n - 2) + [BOI]
        assert bool(rows.valid[b, :n].all()) and bool(rows.valid[2 + b, :n].all())  # pads NOT masked
        assert not bool(rows.valid[b, n:].any())  # right padding past the row's length
        assert rows.positions[2 + b, :n].tolist() == list(range(n))
    mask = rows.causal_mask()  # (R, 1, L, L)
    short = len(cond[0])
    assert bool(mask[2, 0, short - 1, :short].all())  # the uncond row's last query sees every pad
    no_cfg = p.rows(prompts, cfg=False)
    assert no_cfg.rows == 2 and not no_cfg.cfg


def test_layout_vocab_and_sampling_defaults(ckpt):
    p = load_prompter(ckpt)
    assert (p.layout.grid_h, p.layout.grid_w, p.layout.num_codes, p.layout.length) == (GRID, GRID, 576, 576)
    assert p.layout.head == (BOI,) and p.layout.eol is None and p.layout.end is None
    assert p.layout.forced().ids.numel() == 0 and p.layout.offset(575) == 575
    assert p.vocab == ImageVocab(TEXT_VOCAB, CODES, TEXT_VOCAB + CODES)  # from config.json
    assert load_prompter(ckpt, grid=4).layout.num_codes == 16
    s = SamplingConfig(**JANUS_SAMPLING)
    assert (s.cfg_scale, s.temperature, s.top_k, s.top_p) == (5.0, 1.0, 0, 1.0)
    seq = p.layout.assemble(torch.arange(576) + TEXT_VOCAB)
    assert seq[0] == BOI and seq.shape == (577,)


def test_tokenizer_file_alone_defaults_to_janus_pro_ids(ckpt):
    p = load_prompter(ckpt / "tokenizer.json")  # config.json beside it: still read
    assert p.vocab.first_id == TEXT_VOCAB
    p = JanusPrompter(load_tokenizer(ckpt))
    assert p.vocab == ImageVocab(102400, 16384, 102400 + 16384)
    with pytest.raises(ValueError, match="overlap the image ids"):
        JanusPrompter(load_tokenizer(ckpt), ImageVocab(100, 16, 116))


def test_special_ids_by_name(tmp_path):
    d = tmp_path / "no_boi"
    make_tokenizer(d / "tokenizer.json", omit=("<begin_of_image>",))
    with pytest.raises(ValueError, match="no token '<begin_of_image>'"):
        load_prompter(d)
    # a special token only tokenizer_config.json declares, and BOS named there
    d = tmp_path / "config_only"
    make_tokenizer(d / "tokenizer.json", special_tokens_map=False, omit=("<｜▁pad▁｜>",))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<｜begin▁of▁sentence｜>", "special": True},
        "added_tokens_decoder": {str(PAD): {"content": "<｜▁pad▁｜>", "special": True}}}))
    p = load_prompter(d)
    assert p.tokenizer.ids["pad"] == PAD and p.tokenizer.ids["bos"] == BOS
    assert p.rows(["x"], cfg=True).tokens[1].tolist()[1] == PAD
    with pytest.raises(ValueError, match="no prompts"):
        p.rows([], cfg=True)
    with pytest.raises(FileNotFoundError):
        load_prompter(tmp_path / "nowhere")


def test_a_prompt_longer_than_max_prompt_is_refused(ckpt):
    p = load_prompter(ckpt, max_prompt=40)
    assert p.max_prompt == 40 and p.rows(["a cat"], cfg=True).tokens.shape[1] <= 40
    with pytest.raises(ValueError, match="prompt.max_prompt"):
        p.rows(["a cat", "word " * 40], cfg=True)
