from vkvagent.cli import main

raise SystemExit(main())
