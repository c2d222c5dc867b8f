"""The engine's cost table is measured once per job and reused from the outputs."""

from adt_core import AdaptiveConfig, DecodeConfig, Generator, random_bundle
from adt_core.calibrate import CostTable
from pipeline.costs import attach_costs, costs_key
from pipeline.storage import open_storage


def gen(bundle, method="adt"):
    return Generator(bundle, DecodeConfig(method=method, batch_size=2, adaptive=AdaptiveConfig(budget="cost")))


def test_measured_once_then_loaded(tmp_path):
    bundle = random_bundle(seed=0, vocab=16, grid=(3, 3))
    store = open_storage(str(tmp_path / "out"))
    first = gen(bundle)
    assert attach_costs(first, store, "cpu") == "measured"
    key = costs_key("cpu", "float32", 2)
    stored = CostTable.from_json(store.get_text(key))
    assert stored == first.cost_table()
    second = gen(random_bundle(seed=1, vocab=16, grid=(3, 3)))  # another process: nothing cached
    assert attach_costs(second, store, "cpu") == "loaded"
    assert second.cost_table() == stored
    assert attach_costs(gen(bundle, "ar"), store, "cpu") == "unused"


def test_damaged_table_is_measured_again(tmp_path):
    store = open_storage(str(tmp_path / "out"))
    store.put_text(costs_key("cuda:0 (NVIDIA H200)", "float32", 2), "{not json")
    g = gen(random_bundle(seed=0, vocab=16, grid=(3, 3)))
    assert attach_costs(g, store, "cuda:0 (NVIDIA H200)") == "measured"
    assert costs_key("cuda:0 (NVIDIA H200)", "float32", 2) == "costs/cuda-0-nvidia-h200-float32-b2.json"
