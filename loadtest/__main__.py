from loadtest.cli import main

raise SystemExit(main())
