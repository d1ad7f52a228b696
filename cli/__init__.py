"""The `kvchat` command line: the app, or a terminal subcommand (chat, serve, bench, estimate)."""
