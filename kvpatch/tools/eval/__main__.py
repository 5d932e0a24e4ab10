from kvpatch.tools.eval.cli import main

raise SystemExit(main())
