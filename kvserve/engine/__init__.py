"""The engine: EngineCore (schedule -> execute -> update) and the frontend around it."""
