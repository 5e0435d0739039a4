from openk3.cli import main

raise SystemExit(main())
