"""Session fixtures: the tiny random model (written once, loaded once), SmolLM2, and the device of
the ``gpu`` tests; ``order``, the CPU emulator's thread orders a kernel test runs under. Builders
that take them (make_engine, make_seq, make_scheduler) are in tests/utils.py."""

import os

import numpy as np
import pytest

from engine import emulation as E
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.gpu_target import EMULATE, make_device


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random LLaMA in Hugging Face layout (see model_loader/synthetic.py)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """The tiny model loaded once for every module; tests only read it."""
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded once for every module (about 3 s a load); tests only read it."""
    return load_model("smollm2")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip where CuPy sees no GPU, saying why; with REQUIRE_GPU=1 the run
    stops there instead, non-zero, with that reason (a GPU check must not pass by skipping)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or EMULATE:
        return
    from engine.devices.device import gpu_status

    count, why = gpu_status()
    if count:
        return
    if os.environ.get("REQUIRE_GPU") == "1":
        pytest.exit(f"REQUIRE_GPU=1 but no GPU: {why}", returncode=3)
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=f"no GPU: {why}"))


@pytest.fixture(scope="session")
def gpu_device():
    """The device of the ``gpu`` tests (tests/gpu_target.py), built once."""
    return make_device()


@pytest.fixture(params=E.ORDERS)
def order(request):
    """Each block's threads (and the blocks) run forward, reversed and shuffled under the CPU
    emulator: a missing barrier shows as a wrong result in some order."""
    E.set_thread_order(request.param, seed=int(np.random.default_rng().integers(1, 2**31)))
    yield request.param
    E.set_thread_order("forward")
