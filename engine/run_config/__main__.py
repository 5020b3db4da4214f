"""``python -m engine.run_config [--out ds_configs/schema]``: write the scripts' JSON Schemas."""

from engine.run_config.schema import main

raise SystemExit(main())
