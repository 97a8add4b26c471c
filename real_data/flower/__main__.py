from real_data.flower.simulation import main

raise SystemExit(main())
