"""Experiment sweeps: a grid of trainer jobs spread over GPU slots, safe to start again.

- ``spec``: the sweep file (base configs × datasets × override grid × seeds) into named jobs.
- ``overrides``: ``--set`` keys and the old tuning names, checked against the trainer's config.
- ``job_names``: readable job names from what makes each job different.
- ``jobs``: ``Job`` and ``Sweep``; each job's command line and its entry in ``sweep.json``.
- ``locks``: one lock file per job (PID, host, start time), stale ones taken over.
- ``status``: what a job folder says (finished? progress?), ``sweep.json`` and the terminal table.
- ``runner``: starts jobs as GPU slots free, retries failures, stops cleanly on a signal.
- ``slurm_script`` and ``slurm``: the sweep as one SLURM job array (``--backend slurm``): the batch
  script; submission, the queue's view (squeue/sacct) and ``sweep status``.

Standard library plus yaml; the jobs themselves import torch, the sweep never does.
"""
