"""Pictures made from what the ranks really did: buffer tables, a trace stepper, traffic plots.

Every function here draws from `course_lib.traffic` recordings or from tensors returned by a
launch; nothing is drawn by hand. matplotlib only; colours come with hatching or labels so the
figures read in light and dark themes and without colour vision.
"""

from course_lib.viz.buffers import *  # noqa: F401,F403
from course_lib.viz.stepper import *  # noqa: F401,F403
from course_lib.viz.traffic_plots import *  # noqa: F401,F403
from course_lib.viz.schedule import *  # noqa: F401,F403
