import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one thread; more threads only fight over a loaded CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
