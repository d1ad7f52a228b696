"""The application around the rooms: the entry point, the main window that wires chat, dashboard and dialogs to
the engine thread, and process-wide concerns (logging, garbage collection, the self-test)."""
