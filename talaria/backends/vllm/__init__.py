"""The vLLM backend: Talaria's instance core deciding, vLLM v1 engines executing.

One file per concept: ``catalog`` (the models and their engine arguments), ``engines`` (one
``AsyncLLM`` per model on a private event loop), ``executor`` (the
:class:`~talaria.executor.Executor` over them), ``forcing`` (the logits processor
that replays teacher-forced answers inside vLLM), ``cluster`` (the cluster core over one
vLLM instance) and ``model_dirs`` (the embedded catalog's models as directories vLLM loads).
vLLM is optional: nothing here is imported unless the backend is chosen, and only
``engines``, ``executor`` and ``forcing`` import vLLM itself (lazily where they can).
"""
