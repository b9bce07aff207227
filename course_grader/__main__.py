import sys

from course_grader.cli import main

sys.exit(main())
