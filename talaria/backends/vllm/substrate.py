"""The vLLM substrate: Talaria's instance core deciding, vLLM engines executing.

:class:`VllmSubstrate` satisfies :class:`~talaria.runtime.substrate.Substrate`, so the live
loop drives it exactly as it drives the embedded engine: ``plan`` asks the instance core,
``execute`` (a worker thread) carries the decision out on the engines of
:class:`~talaria.backends.vllm.engines.EngineSet`, ``commit`` reports back. What each part of
a schedule means here:

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
  (``num_cached_tokens``); the core's estimate beside it is kept in ``kv_drift``.
* **ends**: the loop's stop checker decides (stop strings, end ids, ``max_tokens``); a call
  it ends is aborted in vLLM. A stream vLLM ends on its own (an end id) stops the call too.

Thread-safety follows the protocol: ``execute`` touches only this object's streams and the
schedule's captured requests; ``plan``/``commit`` run on the loop's thread.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from talaria.backends.vllm.catalog import FORCED_KEY
from talaria.backends.vllm.engines import EngineSet, Stream
from talaria.errors import InstanceFailed, InstanceLost
from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.runtime.instance import InstanceCore
from talaria.schedule import Executed, Request, Schedule

DEFAULT_STEP_TIMEOUT_S = 600.0  # a step waits this long for vLLM's tokens, then fails


@attrs.frozen
class KvDrift:
    """One call's cached prompt tokens: vLLM's count against the core's account."""

    key: CallKey
    vllm_cached: int
    talaria_cached: int

    @property
    def drift(self) -> int:
        return self.talaria_cached - self.vllm_cached


@attrs.define(eq=False)
class _Prepared:
    params: SamplingParams
    vocab_limit: int | None
    forced: tuple[int, ...] | None


class VllmSubstrate:
    """One instance: its core and the vLLM engines of its models (module docstring)."""

    def __init__(
        self,
        core: InstanceCore,
        engines: EngineSet,
        *,
        vocab_sizes: Mapping[str, int],
        eos_token_ids: Mapping[str, Collection[int]] | None = None,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        params_factory: Callable[..., Any] | None = None,
    ) -> None:
        """``params_factory(params, forced, vocab_limit, vocab)`` builds what the engines take
        for a call (default :func:`vllm_params`; tests pass engines that take other forms)."""
        self._core = core
        self._params_factory = params_factory or vllm_params
        self.engines = engines
        self._vocab = dict(vocab_sizes)
        self.eos = {m: frozenset(ids) for m, ids in (eos_token_ids or {}).items()}
        self.step_timeout_s = step_timeout_s
        self.outputs: dict[CallKey, list[int]] = {}
        self.logprobs: dict[CallKey, list[TokenLogprob]] = {}
        self.kv_drift: list[KvDrift] = []
        self._prepared: dict[CallKey, _Prepared] = {}
        self._ids: dict[CallKey, str] = {}  # vLLM request id of each submitted call
        self._ended: set[CallKey] = set()  # vLLM ended them before the checker did

    @property
    def core(self) -> InstanceCore:
        return self._core

    @property
    def idle(self) -> bool:
        return self._core.idle

    @property
    def executes_kv_moves(self) -> bool:
        """No: vLLM manages its own prefix cache (see the module docstring)."""
        return False

    def vocab_size(self, model: str) -> int | None:
        return self._vocab.get(model)

    # ------------------------------------------------------------------ calls
    def prepare(
        self,
        key: CallKey,
        params: SamplingParams,
        vocab_limit: int | None = None,
        forced: Sequence[int] | None = None,
        resumed: int = 0,
    ) -> None:
        """``resumed`` is accepted and not replayed: vLLM's sampler state cannot be advanced
        from outside, so a resumed call goes on greedily exact, sampled afresh otherwise."""
        del resumed
        self._prepared[key] = _Prepared(
            params, vocab_limit, tuple(forced) if forced is not None else None
        )
        self.outputs.setdefault(key, [])

    def take_output(self, key: CallKey) -> tuple[int, ...]:
        out = tuple(self.outputs.pop(key, ()))
        self.forget(key)
        return out

    def forget(self, key: CallKey) -> None:
        self.outputs.pop(key, None)
        self.logprobs.pop(key, None)
        self._prepared.pop(key, None)
        self._ended.discard(key)
        rid = self._ids.pop(key, None)
        if rid is not None:
            self.engines.abort(rid)

    def restart(self, core: InstanceCore) -> None:
        """vLLM engines are not restarted in place (a dead engine stays dead; see
        ``EngineSet``): the instance stays out of routing until the server restarts."""
        raise InstanceLost("the vLLM engines are not restarted in place; restart the server")

    # ------------------------------------------------------------------ phases
    def plan(self, now: float) -> Schedule:
        return self._core.schedule(now)

    def execute(self, sched: Schedule) -> Executed:
        if sched.switch is not None:
            target = sched.switch.model
            mine = set(self._core.models)
            awake = self.engines.awake if self.engines.sleep_mode else set()  # else all are
            slept = next((m for m in awake if m in mine and m != target), None)
            self.engines.switch(slept, target)
        step = sched.step
        if step is None:
            return Executed(())
        reqs = sched.requests
        for key, _, _ in step.prefill:
            if key not in self._ids:
                self._submit(reqs[key])
        expected = [k for k, n, start in step.prefill if start + n >= reqs[k].prompt_len]
        expected += list(step.decode)
        if not expected:
            return Executed(())
        rids = {self._ids[k]: k for k in expected}
        streams = self.engines.wait(rids, self.step_timeout_s)
        sampled: list[tuple[Request, int]] = []
        with self.engines.cond:
            for rid, key in rids.items():
                stream = streams.get(rid)
                if stream is None:
                    raise InstanceFailed(f"call {key}: its vLLM request is gone")
                if stream.tokens:
                    sampled.append((reqs[key], self._take(key, stream)))
                elif stream.error is not None:
                    raise InstanceFailed(
                        f"vLLM failed call {key} ({type(stream.error).__name__}: {stream.error})"
                    )
                elif stream.finish_reason in ("stop", "length") and key in step.decode:
                    self._ended.add(key)  # vLLM ended it on its own: no token this step
                else:
                    raise InstanceFailed(
                        f"vLLM ended call {key} without an answer ({stream.finish_reason})"
                    )
        return Executed(tuple(sampled))

    def _take(self, key: CallKey, stream: Stream) -> int:
        """One token of ``stream`` into the call's outputs (under the engines' lock)."""
        token = stream.tokens.popleft()
        self.outputs.setdefault(key, []).append(token)
        if stream.logprobs:
            self.logprobs.setdefault(key, []).append(stream.logprobs.popleft())
        return token

    def _submit(self, req: Request) -> None:
        call = req.call
        how = self._prepared.get(req.key) or _Prepared(
            SamplingParams(max_tokens=req.target_output, temperature=0.0), None, None
        )
        params = self._params_factory(
            how.params, how.forced, how.vocab_limit, self._vocab[call.model]
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

    def commit(
        self,
        sched: Schedule,
        done: Executed,
        now: float,
        ends: Callable[[Request, int], bool] | None = None,
    ) -> list[Request]:
        core = self._core
        step = sched.step
        eos = self.eos.get(step.model, frozenset()) if step is not None else frozenset()
        stopped = set()
        for req, token in done.sampled:
            if len(self.outputs[req.key]) == 1:
                self._first_token(req)
            if ends(req, token) if ends is not None else token in eos:
                stopped.add(req.key)
        # calls vLLM ended with no token for them this step (the core must not count one)
        silent, self._ended = self._ended & set(core.running), set()
        finished = core.commit(
            sched, done, now, outputs=self.outputs, stopped=stopped, silent=silent
        )
        for req in finished:  # no-op when vLLM ended it too
            rid = self._ids.get(req.key)
            if rid is not None:
                self.engines.abort(rid)
        return finished

    def _first_token(self, req: Request) -> None:
        """vLLM's prefix-cache hits become the call's cached tokens (the core's estimate is
        kept beside them in ``kv_drift``)."""
        rid = self._ids.get(req.key)
        with self.engines.cond:
            stream = self.engines.streams.get(rid) if rid is not None else None
            cached = stream.cached_tokens if stream is not None else None
        if cached is None:
            return
        estimate = min(req.prompt_len, req.reused_tokens + req.restored_tokens)
        self.kv_drift.append(KvDrift(req.key, cached, estimate))
        req.reused_tokens = min(cached, req.prompt_len)
        req.restored_tokens = 0


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
        "max_tokens": params.max_tokens,
        "output_kind": RequestOutputKind.DELTA,
        "detokenize": False,
    }
    if forced is not None:
        ids = [int(i) for i in forced[: params.max_tokens]]
        return VllmSamplingParams(
            temperature=0.0, ignore_eos=True, extra_args={FORCED_KEY: ids}, **common
        )
    allowed = list(range(vocab_limit)) if vocab_limit is not None and vocab_limit < vocab else None
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
