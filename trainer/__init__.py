"""Reference agentic RL loop on Ray and torch that uses tracestore's public API.

Modules:

* :mod:`trainer.tokenizer`, :mod:`trainer.chat`: a toy tokenizer and chat template;
* :mod:`trainer.task`: a multi-turn calculator task with a verifiable reward;
* :mod:`trainer.policy`: a tiny mixture-of-experts causal LM with routing replay;
* :mod:`trainer.grpo`: group-relative advantages and the clipped objective;
* :mod:`trainer.roles`, :mod:`trainer.loop`: Ray actors and the training loop
  (``python -m trainer`` or ``tracestore train``).

Importing this package does not import torch or Ray; the modules that need
them import them.
"""
