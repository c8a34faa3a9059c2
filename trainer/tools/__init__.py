"""Tools around training, each behind a ``python -m trainer`` verb.

- ``hub``: download a model repository, with a free-space check and a verification (``download``).
- ``export``: a checkpoint's adapter, or merged into its base, as safetensors (``export``).
- ``hardware``: what this machine offers and recommended settings (``info``).
- ``planner``: dry-run a few steps per batch shape and pick the fastest that fits (``plan``, ``--auto-plan``).
"""
