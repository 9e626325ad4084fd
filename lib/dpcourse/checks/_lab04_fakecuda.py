"""Stand-in CUDA generators for lab 04's stretch, so that what a GPU run needs is run, not read.

The check's ranks have no GPU: there ``torch.cuda.get_rng_state_all()`` is ``[]`` and a resume
that hands rank 1 rank 0's CUDA state looks exact. While the learner's ``save_training_state``
and ``resume_training_state`` run, :class:`FakeCuda` puts per-rank generators behind torch.cuda's
random-state functions (``get_rng_state``, ``set_rng_state``, their ``_all`` forms,
``manual_seed``, ``manual_seed_all``, ``seed``, ``seed_all``, ``initial_seed``, with
``is_available``, ``device_count`` and ``current_device`` answering for them): each rank sees
``devices`` GPUs, its current one is the GPU of its own rank (as after
``torch.cuda.set_device(local_rank)``), every GPU of a rank starts from that rank's seed (as
``torch.manual_seed`` seeds them all), and the training loop moves the rank's own GPU's
generator once per step (:meth:`FakeCuda.draw`), as dropout on CUDA tensors would. A state is
a 16-byte ``torch.uint8`` tensor, like a real CUDA generator's (its seed and its offset).

The functions are replaced on ``torch.cuda``, ``torch.cuda.random`` and wherever the learner's
two functions hold them in their globals or closures (``from torch.cuda import
get_rng_state_all``).

Imported by :mod:`dpcourse.checks._lab04_resume`.
"""

from __future__ import annotations

import contextlib

__all__ = ["FakeCuda", "FAKE_FUNCTIONS"]

_GETTERS = ("get_rng_state", "get_rng_state_all")
_SETTERS = ("set_rng_state", "set_rng_state_all")
FAKE_FUNCTIONS = (*_GETTERS, *_SETTERS, "manual_seed", "manual_seed_all", "seed", "seed_all",
                  "initial_seed", "is_available", "device_count", "current_device")


class FakeCuda:
    """``devices`` stand-in GPUs of one rank, the current one ``current``, all seeded ``seed``."""

    def __init__(self, devices: int, current: int, seed: int):
        self.devices, self.current = devices, current
        self.seeds = [seed] * devices
        self.offsets = [0] * devices
        self.got = False  # a getter ran inside the window
        self.set = False  # a setter (or a reseed) ran inside the window

    # --- what the loop does on "the GPU" ----------------------------------------------------
    def draw(self) -> None:
        """One training step's dropout masks, drawn on this rank's own GPU."""
        self.offsets[self.current] += 4

    def states(self) -> list[tuple[int, int]]:
        """(seed, offset) of every GPU of this rank."""
        return list(zip(self.seeds, self.offsets))

    # --- torch.cuda's functions, as the learner calls them --------------------------------
    def _index(self, device) -> int:
        import torch

        if device is None or device == -1:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            index = self.current if device.index is None else device.index
        elif isinstance(device, int) and not isinstance(device, bool):
            index = device
        else:
            raise TypeError(f"a device is an int, a str or a torch.device, not "
                            f"{type(device).__name__}")
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index}; this rank "
                               f"has {self.devices} GPUs)")
        return index

    def _state(self, index: int):
        import torch

        return torch.tensor([self.seeds[index], self.offsets[index]],
                            dtype=torch.int64).view(torch.uint8)

    def get_rng_state(self, device="cuda"):
        self.got = True
        return self._state(self._index(device))

    def get_rng_state_all(self):
        self.got = True
        return [self._state(i) for i in range(self.devices)]

    def set_rng_state(self, new_state, device="cuda"):
        import torch

        index = self._index(device)
        if not torch.is_tensor(new_state) or new_state.dtype != torch.uint8:
            raise TypeError(f"RNG state must be a torch.ByteTensor, not "
                            f"{type(new_state).__name__}"
                            + (f" of {new_state.dtype}" if torch.is_tensor(new_state) else ""))
        if new_state.numel() != 16:
            raise RuntimeError(f"RNG state is wrong size: a CUDA generator's state holds 16 "
                               f"bytes, this one {new_state.numel()}")
        seed, offset = new_state.detach().cpu().clone().contiguous().view(torch.int64).tolist()
        self.seeds[index], self.offsets[index] = seed, offset
        self.set = True

    def set_rng_state_all(self, new_states):
        for index, state in enumerate(new_states):
            self.set_rng_state(state, index)

    def manual_seed(self, seed):
        self.seeds[self.current], self.offsets[self.current] = int(seed), 0
        self.set = True

    def manual_seed_all(self, seed):
        self.seeds = [int(seed)] * self.devices
        self.offsets = [0] * self.devices
        self.set = True

    def seed(self):
        import random

        self.manual_seed(random.getrandbits(63))

    def seed_all(self):
        import random

        self.manual_seed_all(random.getrandbits(63))

    def initial_seed(self):
        return self.seeds[self.current]

    def is_available(self):
        return True

    def device_count(self):
        return self.devices

    def current_device(self):
        return self.current

    # --- the window in which the learner's code runs -----------------------------------------
    @contextlib.contextmanager
    def installed(self, *functions):
        """Replace torch.cuda's random-state functions by this rank's stand-ins while the block
        runs: on torch.cuda, torch.cuda.random, and in the globals and closures of
        ``functions``."""
        import torch.cuda
        import torch.cuda.random as cuda_random

        real = {name: getattr(torch.cuda, name) for name in FAKE_FUNCTIONS
                if hasattr(torch.cuda, name)}
        real_objects = {id(f): name for name, f in real.items()}
        for name in FAKE_FUNCTIONS:
            if hasattr(cuda_random, name):
                real_objects.setdefault(id(getattr(cuda_random, name)), name)
        saved = []  # (namespace dict or module, name, value)
        for module in (torch.cuda, cuda_random):
            for name in FAKE_FUNCTIONS:
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, getattr(self, name))
        for fn in functions:
            glob = getattr(fn, "__globals__", None)
            if glob is None:
                continue
            for key, value in list(glob.items()):
                if callable(value) and id(value) in real_objects:
                    saved.append((glob, key, value))
                    glob[key] = getattr(self, real_objects[id(value)])
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(value) and id(value) in real_objects:
                    saved.append((cell, "cell_contents", value))
                    cell.cell_contents = getattr(self, real_objects[id(value)])
        try:
            yield self
        finally:
            for where, name, value in reversed(saved):
                if isinstance(where, dict):
                    where[name] = value
                else:
                    setattr(where, name, value)
