"""Engine workers from the gateway's side: the connection to one worker,
the fleet behind the EngineClient seam, and the supervisor of local worker
processes (docs/architecture.md, "Workers")."""
