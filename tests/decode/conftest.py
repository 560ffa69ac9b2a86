import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models are dominated by per-op overhead; extra threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def batch_setup():
    """A tiny verifier and a factory per proposer kind (tests/decode/rows.py), for the batched-engine tests."""
    from tests.decode.rows import row_factories

    return row_factories()


@pytest.fixture(scope="session")
def graft_setup():
    """A tiny verifier and drafters of each kind fitted to it (tests/decode/grafts.py), for the graft tests."""
    from tests.decode.grafts import graft_drafters

    return graft_drafters()
