"""Readings of finished (or running) run folders, built on ``trainer.runfolder``; no torch.

- ``report``: the end-of-run HTML report with PNG plots, and the ASCII loss curve.
- ``aggregate``: results across runs and seeds (CSV, JSON, Markdown, a plot).
- ``runinfo``: what one run folder says about its run, for ``list`` and ``export``.
- ``exit_report``: the one line launch_training.sh prints after an abnormal exit.
"""
