import os

import pytest

from tests.support.shards import Samples, make_samples

# pytest-xdist runs the tests in several processes at once: each gets node and XDG caches
# of its own under the ones the environment names, as separate machines would have.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    for _var in ("STOKER_CACHE", "XDG_CACHE_HOME"):
        if os.environ.get(_var):
            os.environ[_var] = os.path.join(os.environ[_var], _worker)


@pytest.fixture
def samples() -> Samples:
    return make_samples(40)


@pytest.fixture(scope="session")
def standin_libs(tmp_path_factory) -> tuple[str, str]:
    """The host-memory stand-in for libcuda and libcufile (tests/standin/), built once per
    session: (libcuda path, libcufile path). For ordering and logic tests only."""
    from tests.support.standin_lib import StandinUnavailable, find_or_build_standin

    try:
        return find_or_build_standin(tmp_path_factory.mktemp("standin"))
    except StandinUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def decoded_cache_restored():
    """The decoded-chunk cache's limit (STOKER_DECODED_CACHE_BYTES and the process's
    readers') as it was, after a test that sets it."""
    from stoker import _process

    variable = _process.DECODED_CACHE_VARIABLE
    before = os.environ.get(variable)
    yield
    if before is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = before
    for value in _process.values():
        if hasattr(value, "chunk_cache_bytes"):
            value.chunk_cache_bytes = int(before) if before else 256 << 20
