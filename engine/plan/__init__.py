"""Before loading: the memory estimate, the model library on this machine, the fit check."""
