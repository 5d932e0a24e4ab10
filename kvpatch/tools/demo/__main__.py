"""``python -m kvpatch.tools.demo``: fetch and convert a demo model."""

from kvpatch.tools.demo import main

raise SystemExit(main())
