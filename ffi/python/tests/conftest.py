"""The pools the tests run against are real and running: the Rust harness
(`cargo test -p lake-ffi --test python`) starts them and passes their
sockets in the environment. Without it these tests skip, saying why."""

import os

import pytest


def _pool(prefix: str):
    names = ("DP_SOCKET", "MIRROR", "CP_SOCKET", "BLOCK_BYTES")
    values = {name: os.environ.get(f"{prefix}{name}") for name in names}
    if not all(values.values()):
        pytest.skip(f"no running pool: start the suite with `cargo test -p lake-ffi --test python` ({prefix}*)")
    values["BLOCK_BYTES"] = int(values["BLOCK_BYTES"])
    return values


@pytest.fixture(scope="session")
def pool_paths():
    paths = _pool("LAKE_")
    # Set by the cargo harness; a pool started by hand (`lake serve`) has
    # no daemon from the future, and the tests needing either say so.
    paths["METRICS"] = os.environ.get("LAKE_METRICS")
    paths["FUTURE_DP_SOCKET"] = os.environ.get("LAKE_FUTURE_DP_SOCKET")
    return paths


def needs(paths, *names):
    missing = [name for name in names if not paths.get(name)]
    if missing:
        pytest.skip(f"needs LAKE_{', LAKE_'.join(missing)} (run through `cargo test -p lake-ffi --test python`)")


@pytest.fixture(scope="session")
def doomed_paths():
    paths = _pool("LAKE_DOOMED_")
    paths["STOP_FILE"] = os.environ["LAKE_DOOMED_STOP_FILE"]
    return paths


@pytest.fixture(scope="session")
def closed_paths():
    """A pool that began to stop: it takes no save."""
    return _pool("LAKE_CLOSED_")


@pytest.fixture(scope="session")
def quota_paths():
    """A pool holding tenant 9 to 4 blocks of L1."""
    return _pool("LAKE_QUOTA_")


@pytest.fixture(scope="session")
def small_paths():
    """A pool whose L1 holds 16 blocks: most of a long request is in L2."""
    return _pool("LAKE_SMALL_")
