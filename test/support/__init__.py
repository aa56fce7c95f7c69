"""What the tests share (one test module never imports another):

- `fake_runner.py`: a model runner whose KV records the tokens written into it, and the
  reference output it implies; `fake_grammar.py`: a grammar backend for it.
- `scheduler_harness.py`, `hicache_harness.py`: a Scheduler (plain, or over a host KV tier) on
  the fake runner, with outputs collected and integrity checked; `model_harness.py`: the model
  + KV pool + attention backend without a scheduler; `gpu_harness.py`: the same on CUDA.
- `engine_checks.py`: checks on an Engine (KV conserved, idle and empty, the stop-path storm);
  `tp_checks.py`: the tensor-parallel checks, `tp_trainer.py` the trainer process they start;
  `server.py`: `ServerProcess`, a real `radixlm serve` for the HTTP tests.
- `overlap_batches.py`, `kernel_batches.py`, `radix_helpers.py`, `sharded_model.py`,
  `thread_comm.py`, `structured.py`: batches, requests, models and data the unit tests build.
"""
