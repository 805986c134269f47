"""Gate-collapse alarm (docs/design.md §5, §6): the exit mass sits on loop 1.

Without LR warmup (or with a small entropy weight β) the exit gate of a LoopLM can learn to
exit after the first loop; the model then trains as a plain transformer and the LM loss does
not show it. The alarm watches the mean exit probability of loop 1 on logged steps.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field


@dataclass
class Alarm:
    """One raised alarm (written to ``RUN_DIR/alarms.jsonl``)."""

    step: int
    kind: str
    message: str


@dataclass
class CollapseAlarm:
    """Fires once mean p_1 > ``threshold`` on ``patience`` consecutive logged steps.

    :meth:`update` returns the `Alarm` when it fires (once per collapse episode: after the
    gate recovers, a new collapse fires again). Its state round-trips through
    :meth:`state_dict` so a resumed run behaves like an uninterrupted one.
    """

    threshold: float = 0.9
    patience: int = 3
    min_step: int = 0
    streak: int = 0
    firing: bool = False
    fired: list[dict] = field(default_factory=list)

    def update(self, step: int, p1: float) -> Alarm | None:
        if step < self.min_step:
            return None
        if p1 > self.threshold:
            self.streak += 1
        else:
            self.streak, self.firing = 0, False
        if self.streak >= self.patience and not self.firing:
            self.firing = True
            alarm = Alarm(step, "exit_collapse",
                          f"exit-gate collapse: mean p_1 = {p1:.3f} > {self.threshold} for {self.streak} "
                          "logged steps — the model is training as a 1-loop transformer "
                          "(use LR warmup and beta >= 0.10)")
            self.fired.append(asdict(alarm))
            print(f"WARNING step {step}: {alarm.message}", file=sys.stderr)
            return alarm
        return None

    def state_dict(self) -> dict:
        return {"streak": self.streak, "firing": self.firing, "fired": list(self.fired)}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.firing, self.fired = state["streak"], state["firing"], list(state["fired"])
