"""The engine's store seam: the EngineConnector protocol the scheduler calls, and the kvstore
connector that loads hits and saves new full blocks."""
