"""Fine-tuning kit trainer: ``python -m trainer <verb>``; docs/architecture.md maps its packages."""
