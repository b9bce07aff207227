import sys

from course_lib.grade.cli import main

sys.exit(main())
