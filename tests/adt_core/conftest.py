import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one thread; more threads only fight over a loaded CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def anole_dir(tmp_path_factory):
    """A tiny Anole bundle directory in the real layouts (tests/adt_core/chameleon_fixtures.py):
    HF target + tokenizer.json, Meta's VQGAN files, a LANTERN drafter directory holding a
    narrow neighbour table (row c: codes c + 1 .. c + 8), bundle.json naming the family."""
    import numpy as np

    from adt_core.bundles.family_bundle import write_family_bundle
    from chameleon_fixtures import make_drafter, make_hf_chameleon, make_tokenizer, make_vqgan

    root = tmp_path_factory.mktemp("anole_bundle")
    make_hf_chameleon(root / "target", seed=3)
    make_tokenizer(root / "target" / "tokenizer.json")
    make_vqgan(root / "vq", n_embed=8192, attn_type=None)
    make_drafter(root / "drafter", root / "target")
    table = ((np.arange(8192)[:, None] + 1 + np.arange(8)[None]) % 8192).astype(np.uint16)
    np.save(root / "drafter" / "top_8191_indices.npy", table)
    write_family_bundle(root, "tiny-anole", "chameleon", {"target": "target", "drafter": "drafter", "vq": "vq"},
                        {"layout": "anole"})
    return root
