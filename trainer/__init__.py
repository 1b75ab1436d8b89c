"""Reference agentic RL loop on Ray and torch that uses tracestore's public API.

Imported as ``tracestore.trainer`` (the source folder is ``trainer/``; see
docs/trainer.md). Modules, from the task up:

* :mod:`.tokenizer`, :mod:`.chat`: a toy tokenizer and chat template;
* :mod:`.task`: a multi-turn calculator task with a verifiable reward;
* :mod:`.policy`, :mod:`.grpo`, :mod:`.warmup`: a tiny mixture-of-experts LM
  with routing replay, the GRPO objective, a supervised warm start;
* :mod:`.sample`: :class:`~.sample.Sample`, what crosses actors and the buffer;
* :mod:`.agent`: the calculator agent's episode, apart from how a turn
  reaches the model;
* :mod:`.rollout`, :mod:`.producer`, :mod:`.learner`, :mod:`.evaluation`: the
  roles (Ray actors) and :mod:`.dispatch`, how samples reach the workers;
* :mod:`.checkpoint`, :mod:`.housekeeping`: checkpoint files; counting,
  reclaiming and draining the run in the store;
* :mod:`.loop`, :mod:`.report`, :mod:`.actors`, :mod:`.clock`: the driver, its
  report, Ray plumbing and time accounting
  (``python -m tracestore.trainer`` or ``tracestore train``).

Importing this package does not import torch or Ray; the modules that need
them import them.
"""
