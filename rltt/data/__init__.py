"""Data for rltt: GSM8K and synthetic GSM8K-format tasks, tokenizers, pretraining text, rewards.

Submodules (imported on use, so ``import rltt.data`` stays light):

- ``rltt.data.synthetic``: generated word problems with a difficulty knob;
- ``rltt.data.gsm8k``: GSM8K loaders, answer extraction, prompt template;
- ``rltt.data.math_sets``: the MATH / MATH-500 and AIME layouts (``\\boxed{}`` answers), read by the
  same loaders;
- ``rltt.data.tokenizer``: train a small BPE or char tokenizer locally;
- ``rltt.data.text``: document sources and resumable block packing for pretraining;
- ``rltt.data.rewards``: reward functions from spec strings and ``RewardRunner``.
"""

from pathlib import Path

GSM8K_SAMPLE_DIR = Path(__file__).resolve().parent / "gsm8k_sample"
"""64 train + 64 test GSM8K problems shipped with rltt (MIT; ``load_gsm8k(GSM8K_SAMPLE_DIR, split)``)."""

__all__ = ["GSM8K_SAMPLE_DIR"]
