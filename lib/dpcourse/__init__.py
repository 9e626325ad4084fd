"""dpcourse: the library behind the data-parallelism course.

Importing the package does nothing but define its version: each idea lives in its own module,
imported where it is used, so a torch-only learner never imports TensorFlow and vice versa.
The layout says who each module is for (ARCHITECTURE.md at the repository root says more):

* the taught code, at the top: ``from dpcourse import dp, ddp, ring, overlap, zero ...``;
* infrastructure beside it: ``launch``, ``devices``, ``data``, ``models``, ``train``;
* ``dpcourse.viz`` (figures and widgets) and ``dpcourse.checks`` (lab checks);
* tooling: ``dpcourse.tools`` (the build, mutation testing, doctor --run, the workshop
  rehearsal) and ``dpcourse.bench`` (``python -m dpcourse.bench ...``).
"""

__version__ = "0.1.0"
