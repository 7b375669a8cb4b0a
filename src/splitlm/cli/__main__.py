from splitlm.cli import main

raise SystemExit(main())
