"""`SamplingParams`: how a rollout samples, validated with one-line errors naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence, get_args

import torch

from rltt.errors import RlttError
from rltt.model.exits import ExitPolicy

Schedule = Literal["dense", "deferred"]
SCHEDULES = get_args(Schedule)

Decoder = Callable[[Sequence[int]], str]


@dataclass
class ThinkingBudget:
    """A thinking budget with a forced answer (reasoning models that think inside ``<think> … </think>``).

    A row that reaches ``budget`` completion tokens without having closed its thinking (the
    ``close`` token ids do not occur in its completion) and without having stopped gets the
    ``interruption`` token ids appended — *forced*, not sampled: they are input for what
    follows, never policy actions (`RolloutBatch.forced_mask`) — and then samples up to
    ``answer_budget`` more tokens. ``interruption`` normally ends with ``close`` (e.g.
    ``"\\n\\nTime is up.\\n</think>\\n\\n"``). A row that closed its thinking in time goes on to
    ``max_new_tokens`` as usual.
    """

    budget: int
    close: list[int]
    interruption: list[int]
    answer_budget: int

    def validate(self, max_new_tokens: int, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str):
            raise RlttError(f"SamplingParams.thinking.{name}: {why}, got {getattr(self, name)!r}")

        def ids(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not value or not all(_is_int(t) for t in value):
                bad(name, "must be a non-empty list of token ids")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in value):
                bad(name, f"ids must be in [0, {vocab_size})")

        if not _is_int(self.budget) or not 1 <= self.budget <= max_new_tokens:
            bad("budget", f"must be an int in [1, max_new_tokens={max_new_tokens}]")
        if not _is_int(self.answer_budget) or self.answer_budget < 1:
            bad("answer_budget", "must be an int >= 1")
        ids("close")
        ids("interruption")

    @property
    def max_completion(self) -> int:
        """The longest completion a forced row can have."""
        return self.budget + len(self.interruption) + self.answer_budget

    def closed(self, completion: Sequence[int]) -> bool:
        """Whether ``completion`` closed its thinking: the ``close`` ids occur in it as a run."""
        k = len(self.close)
        return any(list(completion[i: i + k]) == self.close for i in range(len(completion) - k + 1))

    def at_budget(self, completion: Sequence[int], max_new_tokens: int, room: int) -> tuple[list[int], int] | None:
        """The forced-answer rule, written once for every engine: what a row does that has sampled
        ``budget`` completion tokens ``completion`` without stopping. ``room``: how many tokens the
        row can still be given before the model's positions run out, counting the one it samples
        next (each engine counts its own positions).

        Returns ``(forced, cap)``: append the ``forced`` ids (not sampled), then sample until the
        completion holds ``cap`` tokens — thinking closed in time: no forced ids, on to
        ``max_new_tokens``; still open: the ``interruption``, then ``answer_budget`` more. None
        when there is no room for the interruption and one answer token (the row ends
        ``length``)."""
        if self.closed(completion):
            return [], max_new_tokens
        if len(self.interruption) >= room:
            return None
        return list(self.interruption), len(completion) + len(self.interruption) + self.answer_budget


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling settings of one `RolloutEngine.generate` call.

    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_p`` in (0, 1], ``top_k`` (0 = off): nucleus / top-k filtering after temperature.
    - ``max_new_tokens``: completion length cap (finish reason ``length``).
    - ``stop_token_ids``: a sampled id in this list ends the completion (finish reason
      ``stop``; the stop token is kept as the last completion token). The model config's
      ``eos_token_id`` is added unless ``ignore_eos``.
    - ``stop_strings`` (+ ``decoder``: token ids -> text, e.g. ``tokenizer.decode``): the
      completion ends once its decoded text contains one of them (tokens are kept whole).
    - ``seed``: row r's draws (tokens, sampled exits) are a counter-based hash of (seed, r, token
      index), so they depend neither on the batch-mates nor on the schedule; None draws a seed
      (recorded in the batch).
    - ``prompt_seeds``: one seed per prompt instead: the j-th row of prompt i draws from
      (prompt_seeds[i], j), so a prompt's samples do not depend on the other prompts of the call
      (batched curation); equal to a one-prompt call with ``seed=prompt_seeds[i]``.
    - ``n``: completions per prompt (a group); rows are prompt-major.
    - ``exit_policy``: an `ExitPolicy`, or its text ``final`` | ``fixed:k`` | ``threshold:q`` |
      ``sample`` (docs/design.md §1.8), parsed once when the params are built; None uses the
      model config's.
    - ``schedule``: ``dense`` (every token runs all T steps) or ``deferred`` (docs/design.md §2.1–2.3).
    - ``thinking``: a `ThinkingBudget` (forced answer after ``budget`` unclosed thinking tokens),
      or None.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    decoder: Decoder | None = None
    ignore_eos: bool = False
    seed: int | None = None
    prompt_seeds: list[int] | None = None
    n: int = 1
    exit_policy: str | ExitPolicy | None = None
    schedule: str = "deferred"
    thinking: ThinkingBudget | None = None

    def __post_init__(self) -> None:
        self._parse_exit_policy()

    def _parse_exit_policy(self) -> None:
        """Text to `ExitPolicy`, once (the engines only check the parsed policy against T)."""
        if isinstance(self.exit_policy, str):
            self.exit_policy = ExitPolicy.parse(self.exit_policy, None, field="SamplingParams.exit_policy")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_prompt_seeds(self, num_prompts: int) -> None:
        """Raise a one-line `RlttError` unless ``prompt_seeds`` is None or holds one seed per prompt."""
        if self.prompt_seeds is not None and len(self.prompt_seeds) != num_prompts:
            raise RlttError(f"SamplingParams.prompt_seeds: {len(self.prompt_seeds)} seeds for {num_prompts} prompts")

    def stop_string_in(self, completion: Sequence[int]) -> bool:
        """Whether the decoded ``completion`` contains one of ``stop_strings`` (False without any)."""
        if not self.stop_strings:
            return False
        text = self.decoder(completion)
        return any(s in text for s in self.stop_strings)

    def validate(self, num_loops: int | None = None, vocab_size: int | None = None) -> "SamplingParams":
        """Raise a one-line `RlttError` naming the first bad field; return self."""

        def bad(name: str, why: str):
            raise RlttError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an int >= 0 (0 = off)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an int >= 1")
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an int >= 1")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an int or None")
        if self.prompt_seeds is not None and (isinstance(self.prompt_seeds, (str, bytes))
                                              or not all(is_int(s) for s in self.prompt_seeds)):
            bad("prompt_seeds", "must be a list of ints (one per prompt) or None")
        if self.schedule not in SCHEDULES:
            bad("schedule", f"must be one of {' | '.join(SCHEDULES)}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of ints")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"ids must be in [0, {vocab_size})")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            bad("stop_strings", "must be a list of non-empty strings")
        if self.stop_strings and not callable(self.decoder):
            bad("decoder", "stop_strings need a decoder callable (token ids -> text), e.g. tokenizer.decode")
        if self.thinking is not None:
            if not isinstance(self.thinking, ThinkingBudget):
                bad("thinking", "must be a ThinkingBudget or None")
            self.thinking.validate(self.max_new_tokens, vocab_size)
        self._parse_exit_policy()  # text set after the params were built
        if self.exit_policy is not None and not isinstance(self.exit_policy, ExitPolicy):
            bad("exit_policy", "must be an ExitPolicy, its text (final | fixed:k | threshold:q | sample) or None")
        if num_loops is not None and self.exit_policy is not None:
            self.exit_policy.check(num_loops, field="SamplingParams.exit_policy")
        return self


def stop_token_set(params: SamplingParams, config) -> set[int]:
    """The token ids that end a completion: ``params.stop_token_ids`` plus the model config's
    ``eos_token_id`` (an int or a list of them; None adds nothing) unless ``params.ignore_eos``."""
    stops = set(params.stop_token_ids)
    eos = config.eos_token_id
    if not params.ignore_eos and eos is not None:
        stops |= set(eos if isinstance(eos, list) else [eos])
    return stops


def check_prompts(prompts, vocab_size: int, max_positions: int) -> list[list[int]]:
    """Validate prompts (non-empty lists of in-vocabulary ids within the position limit)."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise RlttError("prompts: expected a non-empty list of token-id lists")
    out = []
    for i, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise RlttError(f"prompts[{i}] is empty: a prompt needs at least one token (e.g. BOS)")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise RlttError(f"prompts[{i}] holds a token id outside [0, {vocab_size}) or a non-int")
        if len(ids) > max_positions:
            raise RlttError(f"prompts[{i}] has {len(ids)} tokens, more than the model's "
                            f"max_position_embeddings={max_positions}")
        out.append(ids)
    return out
