"""Episode tests run tiny models like the rollout tests, on one intra-op thread (the same fixture)."""

from tests.rollout.conftest import _one_thread  # noqa: F401  (an autouse fixture, registered by import)
