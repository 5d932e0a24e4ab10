from kvpatch.eval.cli import main

raise SystemExit(main())
