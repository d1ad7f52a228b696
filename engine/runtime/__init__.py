"""Running a model: the runner (reserve -> forward -> commit), attention backends, sampling, sessions, the engine."""
