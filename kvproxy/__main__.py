from kvproxy.cli import main

raise SystemExit(main())
