"""The vLLM executor: Talaria's instance core deciding, vLLM engines executing.

:class:`VllmExecutor` implements :class:`~talaria.executor.Executor`, so the live loop drives
it exactly as it drives the embedded engine: the loop asks the instance core, ``execute`` (a
worker thread) carries the decision out on the engines of
:class:`~talaria.backends.vllm.engines.EngineSet`, the loop reports back. What each part of a
schedule means here:

* **admission / session-prefill**: a call reaches vLLM only when the core admits it into the
  open slot (its first prefill chunk); it is submitted whole, with the session id (vLLM's
  ``session_id``) and the tenant as ``cache_salt`` (tenants never share prefix-cache
  blocks). vLLM then prefills it in its own chunks: the core's later chunks of that prompt
  cost nothing here, and the chunk that completes the prompt waits for vLLM's first token.
* **decode**: each step hands out one vLLM token per call of the step, waiting for the
  slowest (vLLM steps all of a model's running requests together, so they arrive together;
  a token vLLM produced early waits in its stream for the next step).
* **model switch**: with sleep mode (CUDA), ``sleep(level)`` the old model's engine and
  ``wake_up()`` the new one, timed (``EngineSet.switches``); without it every engine stays
  resident and the switch is only the slot changing (admission is gated, nothing moves).
* **weight stage**: nothing to do (a sleeping engine's weights already wait in host memory).
* **KV moves**: the core's KV manager is an account of vLLM's prefix cache, which vLLM
  manages itself (and, with ``kv_offloading_gib``, offloads to host memory itself); the moves
  the core plans are not executed. The cached tokens each call reports are vLLM's own
  (``num_cached_tokens``, in ``Executed.cached``); the core keeps its estimate beside it
  (``InstanceCore.kv_drift``).
* **ends**: the loop's stop checker decides (stop strings, end ids, ``max_tokens``); a call
  that ended is aborted in vLLM at the next step (``Work.dropped``). A stream vLLM ends on
  its own (an end id) stops the call too (``Executed.silent``).

Thread-safety follows the protocol: ``execute`` touches only this object's request ids and
the engines' streams (under their lock), and reads the work's records.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from talaria.backends.vllm.catalog import FORCED_KEY
from talaria.backends.vllm.engines import EngineSet
from talaria.errors import InstanceFailed, InstanceLost
from talaria.executor import CallRecord, Layout, Work
from talaria.generation import SamplingParams, TokenLogprob
from talaria.grammar import Grammar, GrammarKind
from talaria.memory.kv import CallKey
from talaria.schedule import Executed, Request, Schedule

DEFAULT_STEP_TIMEOUT_S = 600.0  # a step waits this long for vLLM's tokens, then fails


class VllmExecutor:
    """One instance: the vLLM engines of its models (module docstring)."""

    def __init__(
        self,
        models: Sequence[str],
        engines: EngineSet,
        *,
        vocab_sizes: Mapping[str, int],
        eos_token_ids: Mapping[str, Collection[int]] | None = None,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        params_factory: Callable[..., Any] | None = None,
    ) -> None:
        """``params_factory(params, forced, vocab_limit, vocab)`` builds what the engines take
        for a call (default :func:`vllm_params`; tests pass engines that take other forms)."""
        self.models = tuple(models)
        self._params_factory = params_factory or vllm_params
        self.engines = engines
        self._vocab = dict(vocab_sizes)
        self.eos = {m: frozenset(ids) for m, ids in (eos_token_ids or {}).items()}
        self.step_timeout_s = step_timeout_s
        self._ids: dict[CallKey, str] = {}  # vLLM request id of each submitted call

    @property
    def executes_kv_moves(self) -> bool:
        """No: vLLM manages its own prefix cache (see the module docstring)."""
        return False

    def vocab_size(self, model: str) -> int | None:
        return self._vocab.get(model)

    def restart(self, layout: Layout) -> None:
        """vLLM engines are not restarted in place (a dead engine stays dead; see
        ``EngineSet``): the instance stays out of routing until the server restarts."""
        raise InstanceLost("the vLLM engines are not restarted in place; restart the server")

    def execute(self, work: Work) -> Executed:
        for key in work.dropped:  # ended: vLLM stops generating for them
            rid = self._ids.pop(key, None)
            if rid is not None:
                self.engines.abort(rid)
        sched = work.schedule
        if sched.switch is not None:
            self._switch(sched.switch.model)
        step = sched.step
        if step is None:
            return Executed()
        reqs = sched.requests
        for key, _, _ in step.prefill:
            if key not in self._ids:
                self._submit(reqs[key], work.calls.get(key))
        expected = [k for k, n, start in step.prefill if start + n >= reqs[k].prompt_len]
        expected += list(step.decode)
        if not expected:
            return Executed()
        return self._collect(sched, expected, work.calls)

    def _switch(self, target: str) -> None:
        awake = self.engines.awake if self.engines.sleep_mode else set()  # else all are
        slept = next((m for m in awake if m in self.models and m != target), None)
        self.engines.switch(slept, target)

    def _collect(
        self, sched: Schedule, expected: Sequence[CallKey], records: Mapping[CallKey, CallRecord]
    ) -> Executed:
        """One token of each ``expected`` call, as vLLM streams them."""
        reqs, step = sched.requests, sched.step
        rids = {self._ids[k]: k for k in expected}
        streams = self.engines.wait(rids, self.step_timeout_s)
        sampled: list[tuple[Request, int]] = []
        logprobs: list[tuple[CallKey, TokenLogprob]] = []
        cached: list[tuple[CallKey, int]] = []
        silent: set[CallKey] = set()
        with self.engines.cond:
            for rid, key in rids.items():
                stream = streams.get(rid)
                if stream is None:
                    raise InstanceFailed(f"call {key}: its vLLM request is gone")
                if stream.tokens:
                    sampled.append((reqs[key], stream.tokens.popleft()))
                    if stream.logprobs:
                        logprobs.append((key, stream.logprobs.popleft()))
                    rec = records.get(key)
                    if (rec is None or not rec.outputs) and stream.cached_tokens is not None:
                        cached.append((key, stream.cached_tokens))
                elif stream.error is not None:
                    raise InstanceFailed(
                        f"vLLM failed call {key} ({type(stream.error).__name__}: {stream.error})"
                    )
                elif stream.finish_reason in ("stop", "length") and step and key in step.decode:
                    silent.add(key)  # vLLM ended it on its own: no token this step
                else:
                    raise InstanceFailed(
                        f"vLLM ended call {key} without an answer ({stream.finish_reason})"
                    )
        return Executed(
            tuple(sampled), logprobs=tuple(logprobs), silent=frozenset(silent), cached=tuple(cached)
        )

    def _submit(self, req: Request, rec: CallRecord | None) -> None:
        call = req.call
        if rec is None:
            greedy = SamplingParams(max_tokens=req.target_output, temperature=0.0)
            params = self._params_factory(greedy, None, None, self._vocab[call.model])
        else:
            params = self._params_factory(
                rec.params, rec.forced, rec.vocab_limit, self._vocab[call.model]
            )
        rid = f"{call.session_id}:{call.index}:{uuid.uuid4().hex[:12]}"
        self.engines.submit(
            rid,
            call.model,
            call.prompt.tokens(),
            params,
            session_id=str(call.session_id),
            cache_salt=call.tenant,
        )
        self._ids[req.key] = rid


def structured_outputs(grammar: Grammar) -> Any:
    """A Talaria grammar as vLLM's structured outputs (its ``guidance`` backend runs the
    same llguidance; JSON on one line, as the embedded engine writes it)."""
    from vllm.sampling_params import StructuredOutputsParams

    if grammar.kind is GrammarKind.JSON_SCHEMA:
        return StructuredOutputsParams(json=json.loads(grammar.source), disable_any_whitespace=True)
    return StructuredOutputsParams(grammar=grammar.source)


def vllm_params(
    params: SamplingParams,
    forced: Sequence[int] | None,
    vocab_limit: int | None,
    vocab: int,
) -> Any:
    """Talaria's sampling parameters as ``vllm.SamplingParams`` (``DELTA`` outputs, no
    detokenization: Talaria's stop checker reads the ids). Stop strings stay with Talaria's
    checker; a forced answer (a replay) is drawn greedily through the forcing processor."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    common: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.cap,
        "output_kind": RequestOutputKind.DELTA,
        "detokenize": False,
    }
    if forced is not None:
        ids = [int(i) for i in forced[: params.cap]]
        return VllmSamplingParams(
            temperature=0.0, ignore_eos=True, extra_args={FORCED_KEY: ids}, **common
        )
    allowed = list(range(vocab_limit)) if vocab_limit is not None and vocab_limit < vocab else None
    if params.grammar is not None:
        common["structured_outputs"] = structured_outputs(params.grammar)
    return VllmSamplingParams(
        temperature=0.0 if params.greedy else params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logprobs=params.logprobs,
        allowed_token_ids=allowed,
        **common,
    )
