"""TensorFlow and Keras, imported the course's way: quiet, and after triton.

``dpcourse.mirrored`` and ``dpcourse.mirrored_keras`` take ``tf`` and ``keras`` from here, so the
order below holds whichever of them a notebook imports first. Importing TF does not fix its
devices (``dpcourse.devices.split_tf_devices`` still works afterwards).

TensorFlow's chatter (C++ INFO and WARNING lines, "INFO:tensorflow", progress bars) would break
the notebooks' stored outputs, so this module sets ``TF_CPP_MIN_LOG_LEVEL=2`` and
``TF_ENABLE_ONEDNN_OPTS=0`` (only if unset) before it imports TensorFlow, and lowers TF's Python
logger to ERROR: the one side effect of importing it, and the reason it is here and not in each
notebook cell.
"""

from __future__ import annotations

import os
import sys

__all__ = ["tf", "keras", "set_quiet_environment"]


def set_quiet_environment() -> None:
    """Set TensorFlow's two environment defaults, each only if unset: ``TF_CPP_MIN_LOG_LEVEL=2``
    (no INFO or WARNING lines from TF's C++; errors still print) and ``TF_ENABLE_ONEDNN_OPTS=0``
    (no oneDNN custom operations). This module calls it once, when it is imported, before it
    imports TensorFlow.

    Shown in lesson 05, §1.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


set_quiet_environment()


def _preload_triton() -> None:
    """Load triton's native library before TensorFlow's, if triton is installed.

    Measured here (torch 2.14.1 + tensorflow-cpu 2.21): with TF loaded first, torch's first
    ``optimizer.step()`` imports torch._dynamo, which imports triton, whose native library
    then crashes the process (segmentation fault). Loaded before TF, it works. Importing
    triton costs about half a second and does not import torch.
    """
    if "tensorflow" in sys.modules:
        return  # too late to help; nothing to do
    try:
        import importlib.util

        if importlib.util.find_spec("triton") is not None:
            import triton  # noqa: F401
    except Exception:  # a broken triton must not stop the TF side from working
        pass


_preload_triton()

import keras  # noqa: E402 - the environment above must be set before TF is imported
import tensorflow as tf  # noqa: E402


tf.get_logger().setLevel("ERROR")
