from linattn.cli import main

raise SystemExit(main())
