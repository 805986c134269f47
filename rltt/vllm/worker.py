"""vLLM worker extension (``worker_extension_cls="rltt.vllm.worker.RlttWorkerExtension"``).

vLLM mixes this class into its worker; the engine calls its methods by name through
``collective_rpc`` (named methods, not lambdas, so they work in multiprocess mode too).

Exit records. ``rltt_install`` wraps the model runner's ``sample_tokens`` and gives the model a
``row_exits`` callback. For every decode step:

1. the runner's forward and ``compute_logits`` run; ``row_exits`` reads, for each row of the
   input batch, its request's ``extra_args`` (``rltt_exit``: exit policy, ``rltt_key``: the
   row's counter-based key) and how many tokens it has generated (the token index), and the
   model chooses the exits and keeps them (`PendingExits`);
2. vLLM's sampler draws the tokens from the exit step's logits;
3. the wrapper pairs row i with request ``request_ids[i]`` and the token vLLM sampled for it
   (requests whose token vLLM discards — a partial prefill — get nothing), and appends the
   token, its exit t*, its raw and tempered log-probs (computed here from the fp32 logits,
   as the native sampler does) and its gates λ to the record of that request's
   ``(rltt_call, rltt_row)``.

Records are keyed by the caller's own (call, row) ids carried in ``extra_args``, so vLLM's
internal request ids (which get a random suffix) never matter; ``rltt_take(call)`` returns and
drops a call's records as plain Python lists (picklable across processes). A record's length
equals the number of tokens vLLM generated for it; the engine checks both agree.
"""

from __future__ import annotations

from typing import Any

import torch

from rltt.rollout.sampler import logprobs_of
from rltt.vllm.row_exits import RowExits, parse_policy


class RlttWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner`` is vLLM's)."""

    # -- set-up ---------------------------------------------------------------------------
    def rltt_install(self) -> bool:
        """Hook the runner once (idempotent); returns True."""
        runner = self.model_runner
        model = runner.get_model()
        if getattr(runner, "_rltt_installed", False):
            return True
        self._rltt_records: dict[tuple[int, int], dict[str, list]] = {}
        self._rltt_version = 0
        num_loops = model.config.num_loops

        def row_exits(n: int):
            req_ids = list(runner.input_batch.req_ids[:n])
            if len(req_ids) != n or any(r is None for r in req_ids):
                return None  # a warm-up / dummy batch
            policies, keys, counters = [], [], []
            for rid in req_ids:
                state = runner.requests[rid]
                extra = (state.sampling_params.extra_args or {}) if state.sampling_params else {}
                policies.append(parse_policy(extra.get("rltt_exit", model.config.exit_policy), num_loops))
                keys.append(int(extra.get("rltt_key", 0)))
                # the token index in the row's completion (a continuation request starts at rltt_offset)
                counters.append(len(state.output_token_ids) + int(extra.get("rltt_offset", 0)))
            return req_ids, RowExits.build(policies, keys, counters)

        original = runner.sample_tokens

        def sample_tokens(grammar_output):
            pending, model.pending = model.pending, None  # set by this step's compute_logits
            out = original(grammar_output)
            if pending is not None and pending.request_ids is not None and hasattr(out, "sampled_token_ids"):
                self._rltt_record(runner, pending, out)
            return out

        model.row_exits = row_exits
        model.record_exits = True
        runner.sample_tokens = sample_tokens
        runner._rltt_installed = True
        return True

    def _rltt_record(self, runner, pending, out) -> None:
        rows, tokens, temps, keys = [], [], [], []
        for i, rid in enumerate(pending.request_ids):
            index = out.req_id_to_index.get(rid)
            sampled = out.sampled_token_ids[index] if index is not None else []
            if not sampled:
                continue  # partial prefill: vLLM discards this row's token
            state = runner.requests.get(rid)
            extra = (state.sampling_params.extra_args or {}) if state is not None else {}
            if "rltt_call" not in extra:
                continue  # a request not made by rltt's engine
            rows.append(i)
            tokens.append(int(sampled[0]))
            temps.append(float(state.sampling_params.temperature))
            keys.append((int(extra["rltt_call"]), int(extra["rltt_row"])))
        if not rows:
            return
        index = torch.tensor(rows)
        logits, token_t = pending.logits[index.to(pending.logits.device)], torch.tensor(tokens,
                                                                                       device=pending.logits.device)
        raw = torch.empty(len(rows), dtype=torch.float32)
        tempered = torch.empty(len(rows), dtype=torch.float32)
        for temp in sorted(set(temps)):
            sel = torch.tensor([j for j, t in enumerate(temps) if t == temp])
            r, t = logprobs_of(logits[sel.to(logits.device)], token_t[sel.to(logits.device)], temp)
            raw[sel], tempered[sel] = r.cpu(), t.cpu()
        exits = pending.exits[index].tolist()
        gates = pending.gates[:, index].T.tolist()
        for j, key in enumerate(keys):
            rec = self._rltt_records.setdefault(key, {"tokens": [], "exits": [], "raw": [], "tempered": [],
                                                      "gates": []})
            rec["tokens"].append(tokens[j])
            rec["exits"].append(exits[j])
            rec["raw"].append(raw[j].item())
            rec["tempered"].append(tempered[j].item())
            rec["gates"].append(gates[j])

    # -- records --------------------------------------------------------------------------
    def rltt_take(self, call: int) -> dict[int, dict[str, list]]:
        """The records of call ``call`` by row, removed from the worker."""
        taken = {row: rec for (c, row), rec in self._rltt_records.items() if c == call}
        for row in taken:
            del self._rltt_records[(call, row)]
        return taken

    def rltt_drop(self) -> None:
        """Forget every record (after an aborted call)."""
        self._rltt_records.clear()

    # -- weights --------------------------------------------------------------------------
    def rltt_reload(self, version: int, tensors: dict[str, torch.Tensor] | None = None,
                    path: str | None = None) -> dict[str, Any]:
        """Load new weights in place (rltt checkpoint names) from ``tensors`` (in-process) or a
        safetensors file ``path`` (multiprocess), through vLLM's ``reload_weights``, which
        re-runs the CPU weight repacking that a second plain ``load_weights`` would break.
        Returns the new version and a fingerprint of the LM head to check the copy took."""
        if tensors is None:
            from safetensors.torch import load_file

            tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(list(tensors.items())), is_checkpoint_format=True)
        self._rltt_version = int(version)
        return {"version": self._rltt_version, "fingerprint": self.rltt_fingerprint()}

    def rltt_version(self) -> int:
        return self._rltt_version

    def rltt_fingerprint(self) -> float | None:
        """Sum of the LM head's rows (vocab rows only; None under tensor parallelism)."""
        model = self.model_runner.get_model()
        head = model.lm_head.weight
        if head.shape[0] < model.config.vocab_size:
            return None
        return float(head[: model.config.vocab_size].double().sum())
