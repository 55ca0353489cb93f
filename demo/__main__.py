from demo.run import main

raise SystemExit(main())
