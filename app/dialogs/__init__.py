"""The windows that open over the main one: Settings, Models, About."""
