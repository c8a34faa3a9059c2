"""Core training: ``loop.train()`` is the recipe; each piece it calls lives in a module named for its job.

- ``loop``: set-up steps, then the loop, read top to bottom; one ending path for finish, signal and error.
- ``step``: one optimizer step's rows and micro-batches, the loss of a micro-batch (``StepKernels``, where
  a CUDA fast path plugs in) and token-normalised gradient accumulation.
- ``chunked_loss``: the reference path's memory-saving cross-entropy.
- ``optim``: optimizer and learning-rate schedule.
- ``oom_retry``: out-of-memory fallback (smaller micro-batch or shorter rows, same rows per step).
- ``checkpointing``: what a checkpoint holds, resume, retention and the best copy.
- ``checkpoint_files``: the files: atomic save, discovery of the latest complete one, pruning, copies.
- ``evaluation``: validation loss and task metrics during training, and the rule for "best".
- ``task_eval`` and ``generation``: a task (trainer/tasks) scored on ``model.generate()`` across ranks;
  also what ``python -m trainer evaluate`` runs.
- ``signals``: SIGTERM/SIGINT as a request to checkpoint and stop (at once in set-up, between evaluation batches,
  after the step in training); ``should_stop()`` for long set-up work that polls.
- ``step_log``: the per-step training record, expert usage and the progress bar.
- ``run_status``: run.json and the run_start/run_end events.
- ``console`` and ``trackers``: what the terminal and W&B/MLflow/TensorBoard see.
- ``faults``: hooks where tests break a run on purpose.
"""
