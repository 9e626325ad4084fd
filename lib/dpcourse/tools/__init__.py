"""Course tooling: the code that builds, checks and rehearses the course, not code a lesson teaches.

* :mod:`dpcourse.tools.authoring` — the build: jupytext sources -> executed notebooks -> labs
  (``python -m dpcourse build|check|times``);
* :mod:`dpcourse.tools.mutate` — breaks each lab solution one line at a time and lists the broken
  answers a lab check lets through (``python -m dpcourse mutate``);
* :mod:`dpcourse.tools.doctor_run` — every lesson and solution under strict nbval on this machine
  (``python -m dpcourse doctor --run``);
* :mod:`dpcourse.tools.translate` — the Chinese edition: translations keyed by cell id and the
  English text's hash, and the Chinese notebooks built from them (``python -m dpcourse translate``);
* :mod:`dpcourse.tools.workshop` — N pretend learners launching at once, and their settings
  (``python -m dpcourse workshop-check``).

Learners never need to read these: lessons import the taught modules from the top of the
package (``from dpcourse import ddp``) and the infrastructure beside them (``launch``,
``devices``, ``data``). See ARCHITECTURE.md at the repository root.
"""
