"""``python -m kvpatch.demo``: fetch and convert a demo model."""

from kvpatch.demo import main

raise SystemExit(main())
