"""vLLM engines as a Ray instance: the process side of ``talaria serve --backend vllm --ray``.

:class:`VllmWorker` is the :class:`~talaria.backends.ray.actor.Worker` whose executor is a
:class:`~talaria.backends.vllm.executor.VllmExecutor` over the engines it starts in its own
process (one vLLM engine per model, from the model directories its node holds at the paths
the serving process names), so an instance's engines run wherever Ray places the actor and
the serving process keeps only the cores, the router and the session table. The schedule
crosses the wire as for the embedded engine; what comes back adds what vLLM reports beside
the tokens (the calls it ended on its own, the prompt tokens its prefix cache held).

Two calls bring it up: :meth:`start` starts the engines (minutes on a CPU) and says what
the serving process needs to size the instance (sleep mode, block size, device memory);
``attach`` then hands it the layout of the core built from that. A second ``attach`` (the
serving process lost the instance, or Ray restarted the actor) shuts down the engines that
are left and starts them afresh: a vLLM engine is not restarted in place. Calls come from
one caller at a time (the instance's driver); ``ping`` may run beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from talaria.backends.ray.actor import Worker
from talaria.backends.vllm.catalog import VllmModel
from talaria.backends.vllm.cluster import ServedModels, device_total_bytes
from talaria.backends.vllm.engines import EngineSet
from talaria.backends.vllm.executor import VllmExecutor
from talaria.executor import Layout

__all__ = ["EngineFacts", "VllmWorker"]


@attrs.frozen
class EngineFacts:
    """What the serving process sizes a vLLM instance by: whether the engines sleep and
    wake (CUDA), the KV block tokens they settled on, the device's memory (with sleep mode),
    and the cores the engines compute on (CPU)."""

    sleep_mode: bool
    block_size: int
    device_total_bytes: int | None
    cpu_bind: str | None


class VllmWorker(Worker):
    """One instance's vLLM engines (see the module docstring). ``sleep_mode`` None: on where
    the platform supports it."""

    def __init__(
        self,
        name: str,
        models: Sequence[VllmModel],
        *,
        sleep_mode: bool | None = None,
        block_size: int = 16,
        node_id: str = "",
    ) -> None:
        super().__init__(name, [m.name for m in models], node_id)
        self.vllm_models = tuple(models)
        self.sleep_mode = sleep_mode
        self.block_size = block_size
        self._engines: EngineSet | None = None
        self._served: ServedModels | None = None

    def start(self) -> EngineFacts:
        """Start the engines if they are not running (blocks until every one is up; raises
        ``ConfigError`` with vLLM's reason when one cannot start), and say what they are."""
        engines = self._engines
        if engines is None:
            engines = EngineSet(
                self.vllm_models, sleep_mode=self.sleep_mode, block_size=self.block_size
            )
            try:
                engines.start()
            except BaseException:
                engines.close()
                raise
            self._engines = engines
        return EngineFacts(
            engines.sleep_mode,
            engines.block_size,
            device_total_bytes() if engines.sleep_mode else None,
            engines.cpu_bind,
        )

    def _ready(self, layout: Layout) -> VllmExecutor:
        if self._runner is not None:  # attached before: the engines start afresh
            self.close()
        self.start()
        if self._served is None:
            self._served = ServedModels.of(self.vllm_models)
        served, engines = self._served, self._engines
        if engines is None:  # start() set them or raised
            raise RuntimeError("the vLLM engines did not start")
        return VllmExecutor(
            self.model_names, engines, vocab_sizes=served.vocab_sizes, eos_token_ids=served.eos
        )

    def _eos(self) -> dict[str, tuple[int, ...]]:
        return {} if self._served is None else dict(self._served.eos)

    def close(self) -> None:
        """Shut the engines down (idempotent); the next ``start`` starts new ones."""
        engines, self._engines, self._runner = self._engines, None, None
        if engines is not None:
            engines.close()
