"""Calibrating the ``cpu`` hardware profile on the machine it runs on, in one place.

``machine`` measures raw rates (memory bandwidth, matmul throughput), ``engine`` the
embedded engine's own step times (prefill, decode by batch and context, stage copies),
fitted into profile prices; ``plan`` says what is measured and keys it (this machine and a
hash of the code that decides step times), ``cache`` keeps the results on disk, and
``calibrate`` picks auto / fresh / shipped. The router's estimates and the simulator read
the result as a :class:`~talaria.cost.hardware.HardwareProfile` (docs/results/real-engine.md).
"""
