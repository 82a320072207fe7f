from vkvagent.tools.cli import main

raise SystemExit(main())
