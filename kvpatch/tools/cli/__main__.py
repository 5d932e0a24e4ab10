from kvpatch.tools.cli import main

raise SystemExit(main())
