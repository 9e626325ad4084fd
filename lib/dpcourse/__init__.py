"""dpcourse: the library behind the data-parallelism course.

Importing the package does nothing but define its version: each idea lives in its own module
(``dpcourse.devices``, ``dpcourse.launch``, ``dpcourse.data``, ...), imported where it is used,
so a torch-only learner never imports TensorFlow and vice versa.
"""

__version__ = "0.1.0"
