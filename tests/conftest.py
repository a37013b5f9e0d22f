import pytest
from shards import Samples, make_samples


@pytest.fixture
def samples() -> Samples:
    return make_samples(40)


@pytest.fixture(scope="session")
def standin_libs(tmp_path_factory) -> tuple[str, str]:
    """The host-memory stand-in for libcuda and libcufile (tests/standin/), built once per
    session: (libcuda path, libcufile path). For ordering and logic tests only."""
    from standin_lib import StandinUnavailable, build_standin

    try:
        return build_standin(tmp_path_factory.mktemp("standin"))
    except StandinUnavailable as e:
        pytest.skip(str(e))
