"""One file per architecture (HF weight names); `registry.model_class` picks one from config.json."""
