import functools
import sys

import background as background_jobs
import pytest
import torch
from dist_pool import DistPool, InFakeWorld

# pytest keeps each test module's assert-rewritten bytecode only where Python may write
# bytecode: with PYTHONDONTWRITEBYTECODE set (this project's machines set it) every run rewrote
# every test module again, 4 s of each run's collection. Like scripts/bootstrap.sh, which
# byte-compiles the project whatever that variable says, the test process writes its own.
sys.dont_write_bytecode = False

_POOLS: dict[int, DistPool] = {}


@pytest.fixture(scope="session")
def dist_pool():
    """``dist_pool(W)`` -> a DistPool of W gloo ranks, shared by the whole session.

    ``dist_pool(P, fake=True)`` -> this process on the fake process group playing rank 0 of P,
    for the length of each ``run`` (``InFakeWorld``).
    """

    def get(world: int, fake: bool = False) -> DistPool | InFakeWorld:
        if fake:
            return InFakeWorld(world)
        if world not in _POOLS:
            _POOLS[world] = DistPool(world)
        return _POOLS[world]

    yield get
    for pool in _POOLS.values():
        pool.close()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def background(request):
    """``background()`` -> ``{name: result}`` of this test's ``@pytest.mark.background(jobs=...)``
    work, computed on idle cores since the session started (tests/background.py); the call
    waits for what is left."""
    return functools.partial(background_jobs.SESSION.results, request.node.nodeid)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip with a reason when no CUDA device is present; tests with background work
    run last."""
    background_jobs.last(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the background work of the tests that will run (after ``-m`` / ``-k``)."""
    if not session.config.option.collectonly:
        background_jobs.start(session.items)


def pytest_sessionfinish(session):
    background_jobs.SESSION.stop()
