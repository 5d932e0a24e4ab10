from kvpatch.cli import main

raise SystemExit(main())
