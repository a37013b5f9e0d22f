import pytest
from shards import Samples, make_samples


@pytest.fixture
def samples() -> Samples:
    return make_samples(40)
