"""Session fixtures: the tiny random model (written once, loaded once) and SmolLM2. Builders that
take them (make_engine, make_seq, make_scheduler) are in tests/utils.py."""

import pytest

from reference.loader import load_model
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random LLaMA in Hugging Face layout (see tests/tiny_model.py)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """The tiny model loaded once for every module; tests only read it."""
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded once for every module (about 3 s a load); tests only read it."""
    return load_model("smollm2")
