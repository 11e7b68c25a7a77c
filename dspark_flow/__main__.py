from dspark_flow.cli.main import main

raise SystemExit(main())
