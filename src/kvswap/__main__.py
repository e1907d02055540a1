from kvswap.cli import main

raise SystemExit(main())
