import os
import sys

# Tests never reach a model hub; shared helpers live beside the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests: they gain nothing from intra-op
    threads, and on a busy 2-core machine OpenMP's spinning threads made each tiny forward
    ~50x slower (measured: 0.96 s vs 0.019 s). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
