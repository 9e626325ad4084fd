"""Course scripts run as files, not imported: ``train_single.py`` (one device) and
``train_ddp.py`` (the same training under torchrun and DDP). Lesson 04 runs both; their
docstrings give the exact commands. ``dpcourse.ddp_practice.script_path(name)`` finds them."""
