from tokenbroker.cli import main

raise SystemExit(main())
